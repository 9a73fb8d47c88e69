"""Every setting of an experiment, as typed dataclasses.

Each field's ``metadata`` may carry ``flag`` (the command-line flag that overrides it), ``help``,
``choices`` and ``negatable`` (a ``--no-`` form). The flag table, ``config.loader.flag_table()``, is
generated from these, so a setting, its YAML key and its flag are declared once; the ``--model-family``
choices come from the family descriptors in ``config.families``. YAML mirrors the sections: ``model:``,
``data:``, ``parallel:``, ``reorder:``, ``train:``, ``optimizer:``, ``checkpoint:``, ``logging:``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mimo_sft.config.families import family_names
from mimo_sft.parallel.components import ComponentSpec


def opt(default, flag: str | None = None, help: str = "", choices: tuple | None = None, **kw):
    """A dataclass field with its flag and help text attached."""
    meta = {"flag": flag, "help": help, "choices": choices, **kw}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    hf_model: Optional[str] = opt(None, "--hf-model", "Hugging Face Qwen-VL checkpoint folder (config.json, safetensors, processor files)")
    family: str = opt("auto", "--model-family", "model family; 'auto' reads config.json", choices=("auto",) + family_names())
    allow_random_init: bool = opt(False, "--allow-random-init", "build the architecture from --hf-model's config without loading weights")
    pretrained_checkpoint: Optional[str] = opt(None, "--pretrained-checkpoint", "start from the weights of a mimo-sft checkpoint (fresh optimizer and step 0)")
    freeze_vision: bool = opt(False, "--freeze-vision", "do not train the vision tower")
    freeze_projector: bool = opt(False, "--freeze-projector", "do not train the patch merger (projector)")
    freeze_language: bool = opt(False, "--freeze-language", "do not train the language model")
    dtype: str = opt("fp32", "--dtype", "parameter and compute dtype", choices=("fp32", "bf16"))
    lora_rank: int = opt(0, "--lora-rank", "LoRA rank (0: off, full fine-tuning). With LoRA the language model's base weights are frozen and only its adapters train; the vision tower and projector keep following --freeze-vision/--freeze-projector unless a vision target below adapts them (then their base weights are frozen too)")
    lora_alpha: Optional[float] = opt(None, "--lora-alpha", "LoRA alpha; adapters are scaled by alpha / rank (default: alpha = rank, scale 1)")
    lora_dropout: float = opt(0.0, "--lora-dropout", "dropout on the adapters' input, in [0, 1)")
    lora_target_modules: str = opt("linear_qkv,linear_proj,linear_fc1,linear_fc2", "--lora-target-modules", "comma-separated layers that get adapters: language linear_qkv, linear_proj, linear_fc1, linear_fc2; opt-in vision_attn (vision qkv/proj), vision_mlp (vision gate/up/down), merger (patch merger MLP); YAML also takes a list", comma_list=True)
    recompute_granularity: Optional[str] = opt(None, "--recompute-granularity", "language activation recomputation: 'selective' (megatron's recompute modules, see --recompute-modules) or 'full' (whole layers, see --recompute-method); default off", choices=("selective", "full"))
    recompute_method: Optional[str] = opt(None, "--recompute-method", "with full recomputation: 'uniform' (checkpoint groups of --recompute-num-layers layers) or 'block' (the first --recompute-num-layers layers of each stage)", choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = opt(None, "--recompute-num-layers", "layers per recomputed group (uniform) or recomputed layers per stage (block)")
    recompute_modules: str = opt("core_attn", "--recompute-modules", "with selective recomputation: comma-separated megatron recompute modules, core_attn and/or mlp (layernorm needs Transformer Engine in megatron-core 0.19.2: refused); YAML also takes a list", comma_list=True)
    recompute_vision: bool = opt(False, "--recompute-vision", "gradient checkpointing of every vision block (non-reentrant): the tower keeps one block's activations instead of all")
    moe_aux_loss_coeff: float = opt(0.0, "--moe-aux-loss-coeff", "mixture-of-experts models: megatron's load-balancing loss coefficient, per layer (0: off, the default; transformers' router_aux_loss_coef is a different, all-layers-joint loss applied only with output_router_logits, so their values do not correspond)")
    sequence_parallel: bool = opt(False, "--sequence-parallel", "megatron sequence parallelism in the language model (needs tp > 1): norms, dropout and residuals hold 1/tp of the sequence")
    attention_backend: str = opt("auto", "--attention-backend", "attention kernels: 'auto' (torch's variable-length flash kernel where it runs -- a CUDA GPU, bf16 -- else 'sdpa'), 'varlen' (that kernel, refused where it cannot run), 'sdpa' (torch SDPA over padded segment rows: flash/memory-efficient on CUDA, math on CPU) or 'local' (megatron's unfused core, eager vision attention; not with --in-batch-packing)", choices=("auto", "sdpa", "varlen", "local"))


@dataclass
class DataConfig:
    dataset_path: Optional[str] = opt(None, "--dataset-path", "parquet/json/jsonl file or folder, a save_to_disk folder, or a hub name; repeat it for a mixture of several sources (see --dataset-weights)", repeatable=True)
    dataset_weights: Optional[str] = opt(None, "--dataset-weights", "comma-separated weight of each --dataset-path (or data.datasets entry), e.g. 0.5,0.3,0.2: the shares of the drawn samples (normalised; default: equal)")
    datasets: list = opt([], None, "YAML only: the sources of a mixture, a list of {path, weight, name, split, schema, messages_column, images_column, conversations_column, image_root, valid_path, valid_dataset_split, streaming} (docs/data.md, Dataset mixtures)")
    split: str = opt("train", "--dataset-split", "dataset split to read")
    schema: str = opt("auto", "--dataset-schema", "column layout of the dataset", choices=("auto", "messages", "sharegpt"))
    messages_column: str = opt("messages", "--messages-column", "column with chat messages (messages schema)")
    images_column: str = opt("images", "--images-column", "column with the sample's images")
    conversations_column: str = opt("conversations", "--conversations-column", "column with ShareGPT/LLaVA turns")
    cost_dir: Optional[str] = opt(None, "--cost-dir", "folder of the per-row reordering counts that check-data --write-costs writes and --reorder-mode index reads instead of reading rows (default: datasets' cache folder, mimo_sft_costs)")
    streaming: bool = opt(False, "--streaming", "read --dataset-path's parquet shards in place (no Arrow copy of the dataset; rows in shard order, docs/data.md, Streaming sources); WebDataset .tar shards are always read this way")
    image_root: Optional[str] = opt(None, "--image-root", "folder that relative image paths are resolved against (default: the dataset's folder)")
    image_backend: str = opt("auto", "--image-backend", "whose resize images follow: transformers' torchvision or PIL image processor ('auto': the one AutoProcessor picks here, torchvision where it is installed); pick what your inference uses", choices=("auto", "pil", "torchvision"))
    min_pixels: Optional[int] = opt(None, "--min-pixels", "smallest image area after resizing (default: the processor's)")
    max_pixels: Optional[int] = opt(None, "--max-pixels", "largest image area after resizing (default: the processor's)")
    max_image_pixels: int = opt(178_956_970, "--max-image-pixels", "largest image file (width x height, before resizing) accepted; the default is PIL's decompression-bomb limit; 0: no limit (a trusted large file is resized to --max-pixels anyway)")
    video_fps: float = opt(2.0, "--video-fps", "frames sampled per second of a clip (Qwen's own default; the family's transformers video processor picks them with do_sample_frames=True)")
    video_min_frames: Optional[int] = opt(None, "--video-min-frames", "fewest frames sampled from a clip (default: the video processor's, 4)")
    video_max_frames: Optional[int] = opt(None, "--video-max-frames", "most frames sampled from a clip (default: the video processor's, 768)")
    video_min_pixels: Optional[int] = opt(None, "--video-min-pixels", "smallest resized frame area (default: the checkpoint's video_preprocessor_config.json, else the processor's)")
    video_max_pixels: Optional[int] = opt(None, "--video-max-pixels", "largest resized area: per frame for Qwen2.5-VL, per clip for Qwen3-VL and Qwen3.5, as their video processors read it (default: the checkpoint's, else the processor's)")
    video_total_pixels: Optional[int] = opt(None, "--video-total-pixels", "largest number of resized pixels a clip may have over all its frames; a larger clip gets fewer frames, then smaller ones (default: no limit beyond --seq-length)")
    video_cap_pixels_per_frame: bool = opt(False, "--video-cap-pixels-per-frame", "apply qwen-vl-utils' per-frame pixel cap (transformers' cap_pixels_per_frame=True); off by default, as in transformers 5.23")
    seq_length: int = opt(1024, "--seq-length", "tokens per sample after padding/truncation")
    pad_to_seq_length: bool = opt(True, "--pad-to-seq-length", "pad every sample to --seq-length (required by reordering)", negatable=True)
    in_batch_packing: bool = opt(True, "--in-batch-packing", "the language model computes each rank's micro-batch as one padding-free packed sequence (THD, per-sample causal attention); exact against padded rows, so on by default (--no-in-batch-packing computes the padded rows)")
    dataloader_type: str = opt("single", "--dataloader-type", "'single' reads in order, 'cyclic' reshuffles each epoch", choices=("single", "cyclic"))
    drop_last: bool = opt(True, "--drop-last", "drop the incomplete last global batch of an epoch", negatable=True)
    num_workers: int = opt(-1, "--num-workers", "DataLoader worker processes per rank (-1: from the CPUs each rank of the node may use, no more than /dev/shm holds)")
    max_bad_samples: int = opt(10, "--max-bad-samples", "samples that cannot be read (an image or clip that is corrupt or gone mid-run, a row that cannot be trained on) that are skipped, counted once over all ranks and named in the log before the run stops (0: stop at the first)")
    on_truncation: str = opt("drop", "--on-truncation", "what to do with a sample whose image tokens do not fit in --seq-length", choices=("drop", "error"))
    valid_dataset_path: Optional[str] = opt(None, "--valid-dataset-path", "validation set: a dataset in the training set's format and schema (same columns and image settings); evaluated in dataset order, never trained on; with several --dataset-path, repeat it once per source for a validation loss per source", repeatable=True)
    valid_dataset_split: str = opt("train", "--valid-dataset-split", "split of --valid-dataset-path to read (a single file is split 'train')")
    valid_split: Optional[str] = opt(None, "--valid-split", "hold out N samples (an integer) or a FRACTION in (0, 1) of the training set as the validation set: a fixed seeded choice, never trained on")


@dataclass
class ParallelConfig:
    components: dict = opt({}, None, "module name -> {tp, pp, cp, dp, etp, rank_offset}; flag: --component NAME=k=v,...")
    world_size: Optional[int] = opt(None, "--world-size", "total ranks (default: implied by the components)")
    scalable_dp: bool = opt(False, "--scalable-dp", "every data rank reads only its canonical-grid shard of each micro-batch")

    def specs(self) -> list[ComponentSpec]:
        from mimo_sft.parallel.components import component_from_mapping, parse_component

        specs = []
        for name, value in self.components.items():
            where = f"parallel.components.{name}"
            if isinstance(value, str):  # the --component syntax without the name: "tp=1,dp=2,rank_offset=2"
                spec = parse_component(f"{name}={value}")
            elif isinstance(value, dict):
                spec = component_from_mapping(name, value, where=where)
            else:
                from mimo_sft.errors import UserError

                raise UserError(f"{where}: expected a mapping such as {{tp: 1, dp: 2, rank_offset: 0}} "
                                f"or a string 'tp=1,dp=2,rank_offset=0', got {value!r}")
            specs.append(spec)
        return specs


@dataclass
class ReorderConfig:
    enabled: bool = opt(False, "--intra-microbatch-reorder", "balance each micro-batch's vision load across DP ranks")
    encoder_cost_weight: float = opt(1.0, "--reorder-encoder-cost-weight", "cost per vision patch")
    language_cost_weight: float = opt(0.0, "--reorder-language-cost-weight", "cost per real language token (0: vision only)")
    overlap: bool = opt(True, "--overlap-intra-microbatch-reorder", "exchange the next window on a background thread", negatable=True)
    mode: str = opt("index", "--reorder-mode", "'index': each rank computes its shard's costs (image headers, token counts), the ranks all-gather them, every rank computes the balanced plan and decodes only its own samples (no sample bytes cross ranks); 'exchange': ranks decode their shard and exchange samples over gloo", choices=("index", "exchange"))
    window_size: int = opt(1, "--reorder-window-size", "micro-batches exchanged together (one all-to-all per window; each micro-batch is balanced on its own)")
    encoder_balance: bool = opt(False, "--encoder-balance", "colocated layouts: encode each image on the least-loaded vision tower of its DP group and send its embeddings (and their gradients) back; splits samples of several images, which sample placement cannot")
    calibrate_from: Optional[str] = opt(None, "--reorder-calibrate-from", "set both cost weights from the encoder and language phases an earlier run measured (its output folder, metrics.jsonl)")
    calibration: str = opt("", None, "where the cost weights came from (written by --reorder-calibrate-from)")


@dataclass
class TrainConfig:
    micro_batch_size: int = opt(4, "--micro-batch-size", "samples in one global MIMO micro-batch (all DP ranks together)")
    global_batch_size: int = opt(8, "--global-batch-size", "samples per optimizer step; a multiple of --micro-batch-size")
    train_iters: int = opt(10, "--train-iters", "optimizer steps")
    seed: int = opt(1234, "--seed", "seed for init, data order and dropout")
    dist_timeout_s: int = opt(600, "--dist-timeout", "seconds a collective may wait for a silent peer before the run fails")
    hang_timeout_s: Optional[int] = opt(None, "--hang-timeout", "seconds without progress before the watchdog dumps every rank's stack to OUTPUT_DIR/hang/, names the stuck rank and exits 75 (default: the larger of 10 min and 20x the median step, a minute under --dist-timeout; 0: off)")
    exit_signal_handler: bool = opt(False, "--exit-signal-handler", "on SIGTERM or SIGUSR1 (any rank), finish the step, save a checkpoint and exit 0")
    exit_interval: Optional[int] = opt(None, "--exit-interval", "save and exit 0 after the first step divisible by N")
    exit_duration_in_mins: Optional[float] = opt(None, "--exit-duration-in-mins", "save and exit 0 before M minutes of wall time have passed")
    gpu_memory_gb: Optional[float] = opt(None, "--gpu-memory-gb", "memory of one GPU in GiB that the memory forecast must fit (check 23; an '80 GB' H100 is 80; default: this machine's GPU, else 80)")
    eval_interval: Optional[int] = opt(None, "--eval-interval", "evaluate on the validation set every N steps (a validation set is always evaluated after the last step)")
    eval_iters: str = opt("50", "--eval-iters", "validation batches of --global-batch-size samples per evaluation, from the start of the validation set, or 'all' (the whole validation set at every evaluation; an old explicit 0 means the same)")
    eval_at_start: bool = opt(False, "--eval-at-start", "also evaluate before the first step (logged as step 0)")


@dataclass
class OptimizerConfig:
    lr: float = opt(1e-5, "--lr", "peak learning rate")
    min_lr: float = opt(0.0, "--min-lr", "learning rate at the end of cosine decay")
    lr_warmup_iters: int = opt(0, "--lr-warmup-iters", "linear warmup steps (a resumed run: the checkpoint's unless given)")
    lr_decay_iters: Optional[int] = opt(None, "--lr-decay-iters", "steps over which the learning rate warms up and decays to --min-lr; later steps stay at --min-lr (default: --train-iters; a resumed run: the checkpoint's, so another --train-iters continues its schedule, and giving this re-stretches it)")
    lr_decay_style: str = opt("cosine", "--lr-decay-style", "decay after warmup", choices=("cosine", "linear", "constant"))
    vision_lr: Optional[float] = opt(None, "--vision-lr", "peak learning rate of the vision tower (its blocks and patch embedding, and their LoRA adapters); same schedule shape as --lr, --min-lr scaled alike (default: --lr)")
    projector_lr: Optional[float] = opt(None, "--projector-lr", "peak learning rate of the patch merger (projector) and its adapters; same schedule shape as --lr (default: --lr)")
    weight_decay: float = opt(0.0, "--weight-decay", "AdamW weight decay of the weight matrices; norms and biases get none")
    adam_beta1: float = opt(0.9, "--adam-beta1", "Adam beta1")
    adam_beta2: float = opt(0.95, "--adam-beta2", "Adam beta2")
    adam_eps: float = opt(1e-8, "--adam-eps", "Adam epsilon")
    clip_grad: float = opt(1.0, "--clip-grad", "global gradient-norm clip (0 disables)")
    use_distributed_optimizer: bool = opt(True, "--use-distributed-optimizer", "shard optimizer state (Adam moments, fp32 main weights) across DP ranks; on by default (LoRA runs use the plain optimizer)", negatable=True)
    overlap_grad_reduce: bool = opt(True, "--overlap-grad-reduce", "reduce each gradient bucket over DP as soon as the last micro-batch's backward has produced it, overlapped with the rest of backward (megatron DDP); exact, so on by default (--no-overlap-grad-reduce: one reduction after backward)")
    overlap_param_gather: Optional[bool] = opt(None, "--overlap-param-gather", "distributed optimizer: all-gather the updated weights bucket by bucket during the next forward instead of right after the optimizer step (default: on where the distributed optimizer is in use and --overlap-grad-reduce is on)", negatable=True)
    ddp_bucket_size: Optional[int] = opt(None, "--ddp-bucket-size", "parameters per gradient-reduction bucket with --overlap-grad-reduce (default: megatron's, max(40M, 1M x DP size); smaller buckets start reducing earlier, at more collectives per step)")


@dataclass
class CheckpointConfig:
    save: Optional[str] = opt(None, "--save", "checkpoint folder (default: OUTPUT_DIR/checkpoints)")
    save_interval: Optional[int] = opt(None, "--save-interval", "save every N steps; the final step is always saved unless --no-save")
    no_save: bool = opt(False, "--no-save", "keep no weights: write no checkpoint at all, not even the final one (refused with --save, --save-interval, --export-hf and the --exit-* flags, which need one)")
    load_checkpoint: Optional[str] = opt(None, "--load-checkpoint", "resume model, optimizer, scheduler, RNG and data position from this folder (its LoRA settings, freeze flags and LR schedule too, unless a flag gives them); 'auto': from the latest complete checkpoint under --save (default OUTPUT_DIR/checkpoints), or start fresh when there is none (the same command line serves a requeued job)")
    resume_auto: bool = opt(False, None, "set when --load-checkpoint auto was resolved (not a setting)")
    recorded: str = opt("", None, "what was taken from the checkpoint the run starts from because no flag gave it (written when the config is loaded, not a setting)")
    export_hf: Optional[str] = opt(None, "--export-hf", "write the final weights as a Hugging Face folder here")
    export_shard_size: str = opt("5GB", "--export-shard-size", "largest safetensors shard of a Hugging Face export (transformers' max_shard_size: 5GB, 500MB or bytes); the export streams one layer at a time into shards of this size")
    keep_last_checkpoints: Optional[int] = opt(None, "--keep-last-checkpoints", "after each save, remove all but the newest N checkpoints (default: keep all)")
    async_save: bool = opt(False, "--async-save", "write periodic checkpoints in the background while training goes on (published once every rank's bytes are on disk; a run waits for its last one)")
    save_reshardable: bool = opt(False, "--save-reshardable", "distributed optimizer: save its state in the form that resumes on any TP/PP (each DP rank writes and reads its own shard, as with the default form, which resumes on any DP size with TP and PP as saved)")
    save_best: bool = opt(False, "--save-best", "save a checkpoint whenever valid_loss reaches a new low and name it in CHECKPOINTS/best (never removed by --keep-last-checkpoints)")


@dataclass
class LoggingConfig:
    output_dir: str = opt("runs/mimo-sft", "--output-dir", "metrics.jsonl, TensorBoard events, resolved config, checkpoints")
    log_interval: int = opt(1, "--log-interval", "print a progress line every N steps")
    straggler_threshold: float = opt(1.5, "--straggler-threshold", "warn (once, with its host) about a rank whose work per step (its step time less its waits on other ranks) stays above this many times the median of its peers' (ranks of the same modules) for 3 log intervals in a row; the progress line names the slowest rank at every log interval")
    tensorboard: bool = opt(True, "--tensorboard", "write TensorBoard event files", negatable=True)
    peak_tflops: Optional[float] = opt(None, "--peak-tflops", "dense bf16 peak TFLOP/s of one GPU, for MFU (default: looked up from the GPU's name; docs/benchmarks.md has the table)")
    wandb_project: Optional[str] = opt(None, "--wandb-project", "log the config and every metric to this Weights & Biases project (WANDB_MODE=offline works without network; needs: pip install wandb)")
    wandb_exp_name: Optional[str] = opt(None, "--wandb-exp-name", "W&B run name (default: the output folder's name)")
    wandb_save_dir: Optional[str] = opt(None, "--wandb-save-dir", "folder for W&B's local files (default: OUTPUT_DIR/wandb)")
    mlflow_tracking_uri: Optional[str] = opt(None, "--mlflow-tracking-uri", "log the config and every metric to this MLflow tracking server or store (a local folder or file: URI works offline; needs: pip install mlflow-skinny)")
    mlflow_experiment: Optional[str] = opt(None, "--mlflow-experiment", "MLflow experiment name (default: mimo-sft); alone, it logs to the MLFLOW_TRACKING_URI environment variable's store, else OUTPUT_DIR/mlruns")
    profile_steps: Optional[str] = opt(None, "--profile-steps", "record a torch.profiler trace of steps A through B (1-based, e.g. 3:4) on each rank of --profile-ranks, with the step's phases as named ranges; written per rank under --profile-dir (Perfetto: the .pt.trace.json file; TensorBoard: its profiler plugin on the folder)")
    profile_ranks: Optional[str] = opt(None, "--profile-ranks", "comma-separated ranks that record --profile-steps (default: every rank)")
    profile_dir: Optional[str] = opt(None, "--profile-dir", "folder of the --profile-steps traces (default: OUTPUT_DIR/profile)")
    save_grads: Optional[str] = opt(None, "--save-grads", "debugging: write each step's reduced gradients (before clipping) as a layout-free checkpoint under DIR/iter_N")


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    reorder: ReorderConfig = field(default_factory=ReorderConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    #: the ``(section, key)`` pairs the user gave (a flag, or a key of the YAML), as opposed to defaults: what a
    #: checkpoint the run starts from may fill in (``config.recorded``) and what it must agree with (checks 20, 24)
    given: frozenset = field(default=frozenset(), compare=False, repr=False)


SECTIONS = ("model", "data", "parallel", "reorder", "train", "optimizer", "checkpoint", "logging")
