"""mimo-sft: multimodal SFT of Qwen-VL models on megatron-core's MIMO model."""

__version__ = "0.1.0"
