"""Configuration: the engine's knobs (vLLM's names and meanings), and the model's shape read from config.json
(`ModelConfig`, from config_json.py)."""

from __future__ import annotations

import math
import numbers
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from tinypaged.config_json import ModelConfig
from tinypaged.core.kv_cache_manager import KVCacheManager
from tinypaged.core.reservation import KV_RESERVATIONS, make_kv_cache_manager
from tinypaged.core.schedule_types import SchedulerConfig
from tinypaged.errors import ConfigError
from tinypaged.quantization import QUANTIZATIONS, canonical_quantization, resolve_quantization
from tinypaged.speculative import SpeculativeConfig


def _arg(default: Any, help: str, **meta: Any) -> Any:  # noqa: A002 - argparse's word
    """An engine argument: its default, and the help (and choices) its CLI flag shows."""
    return field(default=default, metadata={"help": help, **meta})


# Where `tinypaged serve`'s defaults differ from `LLM`'s (as vLLM's server and LLM class differ): a server's streams
# wait for every step, so its steps stay short. 512 tokens a step keep a W1-like burst's inter-token p99 under 40 ms
# on an H200 (2,048: ~107 ms), at 3-8% of offline throughput, which the larger default keeps (BENCHMARKS.md).
SERVE_DEFAULTS = {"max_num_batched_tokens": 512}

# Seconds an engine with work may go without a step before it is declared stalled (engine/frontend/liveness.py;
# `tinypaged serve --engine-stall-timeout`). Long enough for the longest legitimate step, with a wide margin. On 2
# CPU cores (the default model) a step of 8,100 prompt tokens took 56 s, 109 s with 20 prompt logprobs; under
# `tinypaged serve`'s 512-token steps, a chunk with 20 prompt logprobs took 8-19 s. A GPU's first steps of a
# shape compile Triton kernels (seconds each).
STALL_TIMEOUT_S = 300.0

# vLLM's names: "fp8" is E4M3 (float8_e4m3fn). E5M2 (a 2-bit mantissa) is not run.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


# An engine argument's annotation -> the Python types its value may have (a bool is not an int here).
_TYPES: dict[str, tuple[type, ...]] = {
    "int": (numbers.Integral,),
    "float": (numbers.Real,),
    "bool": (bool,),
    "str": (str,),
}


def _check_type(name: str, annotation: str, value: Any) -> None:
    """ConfigError unless `value` fits the field's annotation ("int", "float | None", "bool", "str", ...): a value
    of the wrong type would otherwise fail later, in a comparison or deep in the engine."""
    parts = [part.strip() for part in annotation.split("|")]
    kinds = tuple(t for part in parts for t in _TYPES.get(part, ()))
    if (value is None and "None" in parts) or not kinds:
        return
    ok = isinstance(value, kinds) and (bool not in kinds) == (not isinstance(value, bool))
    if not ok or (isinstance(value, numbers.Real) and not math.isfinite(value)):
        want = " or ".join(parts)
        raise ConfigError(f"{name} must be {want}; got {value!r}")


def _check_device(device: str) -> None:
    """`device` is spelt auto, cpu, cuda or cuda:N. Whether the machine has it is asked where the engine runs
    (`resolve_device`): a config is also built where no GPU is (a replica set's HTTP front)."""
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {device!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs: the model directory and every engine argument, with vLLM's names and
    meanings. `LLM(model, **kwargs)` takes these fields and the CLI's flags are made from them, so a new
    argument is one field here. Checked once, when built; the model's shape is read into `model_config`.
    """

    # None: the default model (fetched if missing); a Path to the model directory once built.
    model: str | Path | None = _arg(
        None, "model directory (HF layout, safetensors); default: the default model, fetched if missing"
    )
    tokenizer: str | Path | None = _arg(
        None,
        "a directory with the tokenizer to use instead of the model's (tokenizer.json; tokenizer_config.json for "
        "its chat template and special tokens), as vLLM's --tokenizer, e.g. the base model's beside a GGUF file, "
        "whose own vocabulary is then not converted; default: the model's",
    )
    dtype: str = _arg(
        "auto",
        "weights and activations: auto is float32 on the CPU, the checkpoint's half type on a GPU",
        choices=("auto", "bfloat16", "float16", "float32"),
    )
    device: str = _arg("auto", "auto, cpu or cuda[:N]")
    quantization: str | None = _arg(
        None,
        "quantize the linear layers' weights at load (fp8: E4M3 per output channel, activations per token; int4 / "
        "int8: weight-only, rounded to nearest in groups of 128 columns, int4 with zero points); default: as the "
        "checkpoint's quantization_config says; a format's name (compressed-tensors, gptq, awq, gguf; vLLM's "
        "gptq_marlin, awq_marlin too) only checks that the checkpoint has it (docs/quantization.md)",
        choices=QUANTIZATIONS,
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "the KV cache's dtype: auto is the model's; fp8 (alias fp8_e4m3) stores E4M3 with a scale per layer for "
        "keys and one for values, from the checkpoint or calibrated at startup (docs/quantization.md)",
        choices=KV_CACHE_DTYPES,
    )
    calculate_kv_scales: bool | None = _arg(
        None,
        "an FP8 KV cache's scales (vLLM's flag): on, calibrated at startup even where the checkpoint has k_scale / "
        "v_scale; off, the checkpoint's, else 1.0 (vLLM's default); unset, the checkpoint's, else calibrated",
    )
    seed: int = _arg(0, "seed of the random draws of requests without a seed of their own")
    block_size: int = _arg(16, "tokens per KV cache block", choices=(1, 2, 4, 8, 16, 32, 64, 128))
    gpu_memory_utilization: float = _arg(
        0.9, "fraction of GPU memory for weights, activations and the KV cache"
    )
    num_gpu_blocks_override: int | None = _arg(
        None, "this many KV cache blocks instead of what memory allows"
    )
    swap_space: float = _arg(4.0, "CPU swap space for preempted requests, in GiB")
    # On the CPU the "GPU" cache lives in host memory too.
    cpu_kv_cache_space: float = _arg(
        1.0, "GiB of host memory for the KV cache when the engine runs on the CPU"
    )
    enable_prefix_caching: bool = _arg(
        True, "share the KV blocks of identical prompt prefixes across requests"
    )
    max_num_seqs: int = _arg(256, "most sequences in one step")
    max_num_batched_tokens: int = _arg(
        8192, "most tokens in one step (longer prompts are prefilled in chunks); `tinypaged serve`: 512"
    )
    enable_chunked_prefill: bool = _arg(
        True, "split prompts longer than the step's token budget over several steps (off: refuse them)"
    )
    max_model_len: int | None = _arg(
        None, "longest sequence, prompt included; default: the model's context (an int once built)"
    )
    preemption_mode: str | None = _arg(
        None,
        "how to preempt when blocks run out; default: swap groups of several sequences, recompute the rest",
        choices=("recompute", "swap"),
    )
    kv_reservation: str = _arg(
        "paged",
        "KV memory policy: paged (blocks on demand); orca-oracle, orca-pow2, orca-max reserve one contiguous "
        "extent per sequence up front, as the vLLM paper's Orca baselines (prompt + max_tokens, + max_tokens "
        "rounded up to a power of two, or max_model_len), with no prefix caching (forced off) and recompute "
        "preemption (docs/paper-eval.md)",
        choices=KV_RESERVATIONS,
    )
    enforce_eager: bool = _arg(
        False, "run every step eagerly (no CUDA graphs; on the CPU, no compiled decode step)"
    )
    cuda_graph_max_tokens: int = _arg(
        2048,
        "largest step with prefill chunks, in tokens, replayed from a CUDA graph (larger ones run eagerly; "
        "decode-only steps have graphs up to max_num_seqs); 0: such steps always run eagerly",
    )
    async_scheduling: bool | None = _arg(
        None, "overlap each step's host work with the device's; default: on for a GPU"
    )
    tensor_parallel_size: int = _arg(
        1,
        "ranks the model is split over (one process and GPU each; gloo ranks on the CPU): attention by heads, "
        "the MLP by columns, the vocabulary by rows",
    )
    disable_custom_all_reduce: bool = _arg(
        False,
        "under tensor parallelism on one node's GPUs, NCCL does every all-reduce (by default those of 512 KiB to "
        "8 MiB go through symmetric memory over NVLink)",
    )
    speculative_config: dict[str, Any] | None = _arg(
        None,
        "speculative decoding, vLLM's JSON: method (ngram, draft_model), num_speculative_tokens, prompt_lookup_min, "
        "prompt_lookup_max, model, quantization, disable_by_batch_size (docs/speculative.md); default: none",
    )
    model_config: ModelConfig = field(init=False, repr=False, compare=False)  # read from model/config.json
    # speculative_config as checked (None: no speculation).
    speculative: SpeculativeConfig | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from tinypaged.weights.fetch import resolve_model  # lazy: `tinypaged --help` imports this module

        if self.tokenizer is not None:  # checked first: with it, a GGUF's own vocabulary is not converted
            if (
                not isinstance(self.tokenizer, str | Path)
                or not (Path(self.tokenizer) / "tokenizer.json").is_file()
            ):
                raise ConfigError(
                    f"tokenizer must be a directory holding tokenizer.json; got {self.tokenizer!r}"
                )
            object.__setattr__(self, "tokenizer", Path(self.tokenizer))
        model = resolve_model(self.model, vocabulary=self.tokenizer is None)
        mcfg = ModelConfig.from_dir(model)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "model_config", mcfg)
        if isinstance(self.quantization, str):  # vLLM's spellings: any case, its aliases of the formats
            object.__setattr__(self, "quantization", canonical_quantization(self.quantization))
        for f in self.engine_args():
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if f.name not in ("model", "tokenizer", "speculative_config"):  # checked as they are read
                _check_type(f.name, str(f.type), value)
            if choices is not None and value is not None and value not in choices:
                raise ConfigError(f"{f.name} must be one of {', '.join(map(str, choices))}; got {value!r}")
        limit = mcfg.max_position_embeddings
        if not self.max_model_len:
            object.__setattr__(self, "max_model_len", limit)
        elif self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's context ({limit} tokens)"
            )
        for name, ok, rule in (
            ("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0, "in (0, 1]"),
            (
                "num_gpu_blocks_override",
                self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                ">= 1",
            ),
            ("swap_space", self.swap_space >= 0, ">= 0 GiB"),
            ("cpu_kv_cache_space", self.cpu_kv_cache_space > 0, "> 0 GiB"),
            ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, ">= 1"),
            ("cuda_graph_max_tokens", self.cuda_graph_max_tokens >= 0, ">= 0"),
            ("max_model_len", self.max_model_len >= 1, ">= 1"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, ">= 1"),
        ):
            if not ok:
                raise ConfigError(f"{name} must be {rule}, got {getattr(self, name)}")
        _check_device(self.device)
        if self.kv_reservation != "paged":
            # The paper's Orca baselines share nothing: a reserved extent is one sequence's alone.
            object.__setattr__(self, "enable_prefix_caching", False)
        self._check_tensor_parallel(mcfg)
        raw = self.speculative_config  # checked whole, then against this engine
        object.__setattr__(self, "speculative", SpeculativeConfig.from_dict(raw) if raw is not None else None)
        if (spec := self.speculative) is not None:
            draft = ModelConfig.from_dir(spec.model) if spec.model is not None else None
            spec.check_engine(self, QUANTIZATIONS, (mcfg.vocab_size, draft.vocab_size if draft else None))
            # The draft's schemes, checked as the target's are, before any weight is read.
            dcfg = draft or mcfg
            resolve_quantization(
                dcfg.quantization_config,
                spec.quantization,
                f"speculative_config: {dcfg.path}",
                dcfg.num_layers,
                not dcfg.tie_word_embeddings,
            )
        # Every layer's scheme is checked here, before any weight is read: one line for what cannot be run.
        resolve_quantization(
            mcfg.quantization_config,
            self.quantization,
            str(mcfg.path),
            mcfg.num_layers,
            not mcfg.tie_word_embeddings,
        )

    @property
    def tokenizer_path(self) -> Path:
        """The directory the tokenizer is read from: `tokenizer`, else the model's."""
        return Path(self.tokenizer if self.tokenizer is not None else self.model_config.path)

    def _check_tensor_parallel(self, m: ModelConfig) -> None:
        """The model must split evenly: query heads and the MLP's columns over the ranks, KV heads too or
        each KV head shared by a whole number of ranks (replicated where the ranks outnumber them)."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        problems = []
        if m.num_heads % tp:
            problems.append(f"its {m.num_heads} attention heads")
        if m.num_kv_heads % tp and tp % m.num_kv_heads:
            problems.append(f"its {m.num_kv_heads} KV heads (nor is {tp} a multiple of them)")
        if m.intermediate_size % tp:
            problems.append(f"its MLP width {m.intermediate_size}")
        if problems:
            raise ConfigError(
                f"tensor_parallel_size {tp} does not divide {' and '.join(problems)} ({m.path.name})"
            )

    @classmethod
    def engine_args(cls) -> list[Field[Any]]:
        """The fields `LLM(...)` takes and the CLI makes flags of (all but the derived `model_config`)."""
        return [f for f in fields(cls) if f.init]

    @classmethod
    def from_kwargs(cls, model: str | Path | None = None, **kwargs: Any) -> EngineConfig:
        """Build from engine arguments; ConfigError for an unknown one."""
        known = {f.name for f in cls.engine_args()}
        unknown = sorted(kwargs.keys() - known)
        if unknown:
            raise ConfigError(
                f"unknown engine argument {unknown[0]!r}; the arguments are {', '.join(sorted(known))}"
            )
        return cls(model=model, **kwargs)

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of a block table: enough blocks for a sequence of max_model_len tokens."""
        assert self.max_model_len is not None
        return math.ceil(self.max_model_len / self.block_size)

    def kv_cache_manager(self, num_gpu_blocks: int, num_cpu_blocks: int) -> KVCacheManager:
        """The KV cache manager of `kv_reservation` over pools of these sizes."""
        assert self.max_model_len is not None
        return make_kv_cache_manager(
            self.kv_reservation,
            self.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            self.max_model_len,
            self.enable_prefix_caching,
            self.model_config.uniform_window,
        )

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's part, as core/ takes it."""
        assert self.max_model_len is not None
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            preemption_mode=self.preemption_mode,  # type: ignore[arg-type]
            enable_chunked_prefill=self.enable_chunked_prefill,
        )
