"""The CPU's decode step as one compiled graph: every decoder layer and the final norm of a step whose sequences
each bring one new token, compiled ahead of time by torch's inductor (AOTInductor) into a shared library.

One job: build that library (in a background process, so that nothing waits for it), load it once built, and run
the decode steps it can take. The eager model stays the definition (`llama.py`); this graph computes the same
step with the same kernels for the matmuls (torch's packed INT4 / INT8 kernels, SDPA), and inductor fuses what
lies between them (the residual adds with the norms, the rotary with the cache write, SwiGLU with its casts) into
a few C++ loops a layer. A token of the default model is ~1,800 small torch ops in eager mode, most of whose time
is the ops' own dispatch (benchmarks/HISTORY.md); the graph runs ~15 calls a layer from C++.

Which models: the Llama family and the relatives whose switches are biases (Qwen2), q/k norms (Qwen3) and
sliding windows (Mistral, Qwen's windowed layers), on one rank, with float32 activations and KV cache and every
linear layer on torch's packed CPU kernels (quant/cpu.py): 4-bit weights, grouped 8-bit ones split in nibbles
and per-row INT8 (a GGUF's Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K and Q8_0, GPTQ / AWQ / compressed-tensors,
`quantization="int4"` or "int8"; Q6_K's groups of 16 padded). Anything else (Gemma 3, an FP8 cache), and prefill, mixed
and speculative steps, run eagerly.

The library depends on the model's shapes, not its weights: the weights, the KV cache and the step's tensors are
its inputs. The build (`python -m tinypaged.model.cpu_graph SPEC OUT`) exports the step with placeholder tensors
of the model's shapes (dynamic in the step's tokens, the context length and the cache's blocks), compiles it and
renames the file into place; it runs at a lower priority beside the engine, which serves eagerly until the file
is there. The file is kept under `<TINYPAGED_HOME>/compile/cpu-graph/`, named by a hash of the shapes, torch's
version, the CPU's vector extensions and this file, so a restart loads it in a second. A build that fails leaves
the engine eager, with one warning. `enforce_eager` or TINYPAGED_CPU_GRAPH=0 turns the graph off (the test suite
does, but for the tests of this file).

Numerics: the fused norms sum in another order than `F.rms_norm`, so a value near a bf16 rounding boundary (the
packed kernels take bf16 rows) may round the other way: the logits move by the kernels' own rounding, not more
(tests/model/test_cpu_graph.py).
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tinypaged import ops
from tinypaged.model.quant.cpu import CpuPacked, packed_linear

logger = logging.getLogger(__name__)

ENV = "TINYPAGED_CPU_GRAPH"  # "0": never use the graph
_MAX_TOKENS = 1 << 16  # the dynamic dimensions' bounds
_MAX_LEN = 1 << 24
_MAX_BLOCKS = 1 << 30


@dataclass(frozen=True)
class Linear:
    """One packed INT4 linear layer as the graph takes it: its group, its output width, its tensors' shapes."""

    group: int
    out_features: int
    codes: tuple[list[int], str]  # shape, dtype
    scales: tuple[list[int], str]
    bias: bool = False
    doubled: bool = False  # an 8-bit weight split in nibbles over the input row repeated (quant/cpu.py)
    bits: int = 4  # the kernel's: 4, or 8 for INT8 with one scale a row (`_weight_int8pack_mm`)
    padded: bool = False  # its groups of 16 padded to 32 over zero inputs (Q6_K, quant/cpu.py)


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its qkv, o, gate_up and down layers, its window (None: the whole context) and whether
    it normalises each head of q and k."""

    linears: list[Linear]
    window: int | None = None
    qk_norm: bool = False


@dataclass(frozen=True)
class Spec:
    """What the graph is built from: the model's shapes, never its weights."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    block_size: int
    max_positions: int
    layers: list[Layer]

    def key(self) -> str:
        """The file's name: the shapes, torch, the CPU's vector extensions and this file's source."""
        h = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        h.update(torch.__version__.encode())
        h.update(torch.backends.cpu.get_cpu_capability().encode())
        h.update(_cpu_flags().encode())
        h.update(Path(__file__).read_bytes())
        return h.hexdigest()[:24]

    @staticmethod
    def from_json(text: str) -> Spec:
        d = json.loads(text)
        layers = []
        for layer in d.pop("layers"):
            lins = [
                Linear(**(lin | {"codes": tuple(lin["codes"]), "scales": tuple(lin["scales"])}))
                for lin in layer.pop("linears")
            ]
            layers.append(Layer(lins, **layer))
        return Spec(**d, layers=layers)


def _cpu_flags() -> str:
    """The CPU's model and instruction-set flags (the library is compiled for the machine's own: a cache copied to
    another CPU must not load it), from /proc/cpuinfo where there is one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _shape(t: torch.Tensor) -> tuple[list[int], str]:
    return list(t.shape), str(t.dtype).removeprefix("torch.")


def spec_of(model: torch.nn.Module, kv_cache: torch.Tensor) -> Spec | None:
    """The graph's spec for this model and cache, or None where the graph does not take the model (the
    module's docstring)."""
    from tinypaged.model.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM) or model.tp.size > 1 or kv_cache.device.type != "cpu":
        return None
    cfg = model.cfg
    if (
        cfg.family == "gemma3"
        or cfg.final_logit_softcapping
        or model.embed_scale != 1.0
        or model.local_layers
    ):
        return None
    if kv_cache.dtype != torch.float32 or model.cos_sin_cache.dtype != torch.float32:
        return None
    if any(p.dtype != torch.float32 for n, p in model.named_parameters() if n.endswith("norm.weight")):
        return None
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (
            attn.short_query_len != 1
            or mlp.gelu
            or layer.input_layernorm.fp8
            or layer.post_attention_layernorm.fp8
        ):
            return None
        packed = []
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            p: CpuPacked | None = getattr(lin, "cpu_packed", None)
            if p is None or (lin.bias is not None and lin.bias.dtype != torch.float32):
                return None
            bias = lin.bias is not None
            shapes = (_shape(p.codes), _shape(p.scales))
            packed.append(Linear(p.group, lin.out_features, *shapes, bias, p.doubled, p.bits, p.padded))
        layers.append(Layer(packed, attn.window, attn.qk_norm))
    first = model.layers[0].self_attn
    return Spec(
        hidden=cfg.hidden_size,
        num_heads=first.num_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.head_dim,
        eps=float(model.layers[0].input_layernorm.eps),
        scale=float(first.scale),
        block_size=kv_cache.shape[3],
        max_positions=model.cos_sin_cache.shape[0],
        layers=layers,
    )


# ---------------------------------------------------------------------------------------------------------
# The step, as torch code that export traces: the eager model's decode step for the models `spec_of` takes.
# ---------------------------------------------------------------------------------------------------------


def layer_tensors(layer: torch.nn.Module) -> list[torch.Tensor]:
    """A decoder layer's tensors in the order the graph takes them: each linear layer's codes, scales (and bias),
    then q's and k's norm weights where it has them."""
    attn, mlp = layer.self_attn, layer.mlp
    out = []
    for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        out += [lin.cpu_packed.codes, lin.cpu_packed.scales] + (
            [lin.bias.data] if lin.bias is not None else []
        )
    if attn.qk_norm:
        out += [attn.q_norm.weight.data, attn.k_norm.weight.data]
    return out


def _placeholders(spec: Spec, layer: Layer) -> list[torch.Tensor]:
    """`layer_tensors`' shapes and dtypes, as zeros."""
    dtype = {"uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "bfloat16": torch.bfloat16}
    out = []
    for lin in layer.linears:
        out += [torch.zeros(shape, dtype=dtype[dt]) for shape, dt in (lin.codes, lin.scales)]
        out += [torch.zeros(lin.out_features)] if lin.bias else []
    return out + ([torch.ones(spec.head_dim), torch.ones(spec.head_dim)] if layer.qk_norm else [])


def _linear(x: torch.Tensor, lin: Linear, w: list[torch.Tensor]) -> torch.Tensor:
    """The eager layer's own `packed_linear` (model/quant/cpu.py), traced; takes the layer's tensors from the
    front of `w`."""
    packed = CpuPacked(w.pop(0), w.pop(0), lin.bits, lin.group, lin.doubled, lin.padded)
    return packed_linear(x, packed, w.pop(0) if lin.bias else None)


def _attention(
    spec: Spec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    write: tuple[torch.Tensor, torch.Tensor],
    read: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
) -> torch.Tensor:
    """The new keys and values written into the layer's cache `[2, blocks, block_size, Hkv, D]` at (block,
    offset) `write`, then each token's attention over its context, the cache rows `read`. `index_put_` on the
    cache itself, not on a view of it: on a view, the compiled graph copies the whole cache."""
    kv_layer.index_put_((torch.zeros_like(write[0]), *write), k)
    kv_layer.index_put_((torch.ones_like(write[0]), *write), v)
    blocks, offsets = read
    keys, values = kv_layer[0, blocks, offsets], kv_layer[1, blocks, offsets]  # [T, L, Hkv, D]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :],
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        scale=spec.scale,
        enable_gqa=True,
    )
    return o[:, :, 0, :]


class Step(torch.nn.Module):
    """The decode step: embedded rows `[T, hidden]` in, the final norm's output out (the layers' math is
    `llama.DecoderLayer`'s)."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        lens: torch.Tensor,
        write: tuple[torch.Tensor, torch.Tensor],
        read: tuple[torch.Tensor, torch.Tensor],
        cos_sin: torch.Tensor,
        norms: list[torch.Tensor],
        layers: list[list[torch.Tensor]],
        kv: list[torch.Tensor],
    ) -> torch.Tensor:
        s = self.spec
        t, nh, nkv, d = x.shape[0], s.num_heads, s.num_kv_heads, s.head_dim
        cos, sin = cos_sin[positions].chunk(2, dim=-1)
        cos, sin = torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]
        # Which context positions each token sees: all of its sequence's, or the last `window` of them.
        kpos, lens = torch.arange(read[0].shape[1])[None, :], lens[:, None]
        masks = {None: (kpos < lens)[:, None, None, :]}
        for window in {layer.window for layer in s.layers} - {None}:
            masks[window] = ((kpos < lens) & (kpos >= lens - window))[:, None, None, :]
        residual = x
        h = F.rms_norm(x, x.shape[-1:], norms[0], s.eps)
        for i, layer in enumerate(s.layers):
            w, lins = list(layers[i]), layer.linears  # the linear layers' tensors, taken in turn
            if layer.qk_norm:
                w, (q_w, k_w) = w[:-2], w[-2:]
            qkv = _linear(h, lins[0], w)
            qk = qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d)
            v = qkv[:, (nh + nkv) * d :].view(t, nkv, d)
            if layer.qk_norm:  # Qwen3: each head of q and k normalised, then rotated
                qk = torch.cat(
                    (F.rms_norm(qk[:, :nh], (d,), q_w, s.eps), F.rms_norm(qk[:, nh:], (d,), k_w, s.eps)), 1
                )
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            o = _attention(s, qk[:, :nh], qk[:, nh:], v, kv[i], write, read, masks[layer.window])
            residual = _linear(o.reshape(t, nh * d), lins[1], w) + residual
            h = F.rms_norm(residual, x.shape[-1:], norms[2 * i + 1], s.eps)
            gu = _linear(h, lins[2], w)
            inner = gu.shape[-1] // 2
            residual = _linear(F.silu(gu[:, :inner]) * gu[:, inner:], lins[3], w) + residual
            h = F.rms_norm(residual, x.shape[-1:], norms[2 * i + 2], s.eps)
        return h


def _inputs(spec: Spec, tokens: int, length: int, blocks: int) -> tuple:
    """Placeholder inputs of the spec's shapes: `tokens` new tokens, contexts of `length`, a cache of `blocks`."""
    layers = [_placeholders(spec, layer) for layer in spec.layers]
    n = len(spec.layers)
    norms = [torch.ones(spec.hidden) for _ in range(2 * n + 1)]
    kv = [torch.zeros(2, blocks, spec.block_size, spec.num_kv_heads, spec.head_dim) for _ in range(n)]
    slots = torch.arange(tokens)
    write = (slots // spec.block_size, slots % spec.block_size)
    ctx = torch.arange(length).repeat(tokens, 1)
    read = (ctx // spec.block_size, ctx % spec.block_size)
    lens = torch.full((tokens,), length, dtype=torch.int32)
    cos_sin = torch.zeros(spec.max_positions, spec.head_dim)
    x, positions = torch.zeros(tokens, spec.hidden), torch.zeros(tokens, dtype=torch.int32)
    return (x, positions, lens, write, read, cos_sin, norms, layers, kv)


def build(spec: Spec, out: Path) -> None:
    """Export the step with placeholder inputs and compile it into `out` (written under another name, then
    renamed: a reader never sees a partial file)."""
    dim = torch.export.Dim
    t, length = dim("tokens", min=1, max=_MAX_TOKENS), dim("length", min=1, max=_MAX_LEN)
    blocks = dim("blocks", min=1, max=_MAX_BLOCKS)
    n = len(spec.layers)
    example = _inputs(spec, 3, 5, 4)
    dynamic = (
        {0: t},
        {0: t},
        {0: t},
        ({0: t}, {0: t}),
        ({0: t, 1: length}, {0: t, 1: length}),
        None,
        [None] * (2 * n + 1),
        [[None] * len(layer) for layer in example[7]],
        [{1: blocks}] * n,
    )
    with torch.no_grad():
        program = torch.export.export(Step(spec), example, dynamic_shapes=dynamic)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = _part(out, os.getpid())
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(part))
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _part(out: Path, pid: int | str) -> Path:
    """Where the build of `out` by process `pid` writes before the rename ("*": any build's)."""
    return out.with_name(f".{out.stem}.{pid}.part.pt2")


def enabled() -> bool:
    """Whether the graph may be used (TINYPAGED_CPU_GRAPH is not "0")."""
    return os.environ.get(ENV, "1") != "0"


def graph_dir() -> Path:
    """`<TINYPAGED_HOME>/compile/cpu-graph`: beside Triton's cache."""
    from tinypaged.weights.fetch import tinypaged_home

    return tinypaged_home() / "compile" / "cpu-graph"


class CpuGraph:
    """The graph of one model and KV cache: loaded at once where its file exists, else built in the background
    and loaded by the first decode step after the build ends; `forward` runs the steps it takes."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, spec: Spec, path: Path) -> None:
        self.model, self.spec, self.path = model, spec, path
        layers = model.layers
        norms = [layers[0].input_layernorm.weight]
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
            norms += [layer.post_attention_layernorm.weight, nxt.weight]
        weights = [t for layer in layers for t in layer_tensors(layer)]
        # The inputs after the step's own, flattened as the library takes them (`Step.forward`'s order).
        self._held = [model.cos_sin_cache, *(w.data for w in norms), *weights, *kv_cache.unbind(0)]
        self._run = None
        self._proc: subprocess.Popen | None = None
        self.state = "building"
        self.log = path.with_suffix(".log")
        if path.exists():
            self._load()
        elif path.with_suffix(
            ".failed"
        ).exists():  # not again on every start: the same build fails the same way
            self.state = "failed"
            logger.warning(
                "the CPU decode graph's build failed before (%s; delete it to try again)", self.log
            )
        else:
            self._start()
            atexit.register(self.close)

    def _start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for part in self.path.parent.glob(_part(self.path, "*").name):  # a killed build's (its pid is gone)
            if not _alive(int(part.name.split(".")[2])):
                part.unlink(missing_ok=True)
        spec_file = self.path.with_suffix(".json")
        spec_file.write_text(json.dumps(asdict(self.spec)))
        # The build takes one core; the engine's threads the others meanwhile: an OpenMP team with a thread on a
        # busy core waits for it at every barrier (requests ran 20-50x slower beside a build on two cores).
        self._threads = torch.get_num_threads()
        torch.set_num_threads(max(1, self._threads - 1))
        env = os.environ | {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        with open(self.log, "w") as log:
            me = str(os.getpid())
            cmd = [sys.executable, "-m", "tinypaged.model.cpu_graph", str(spec_file), str(self.path), me]
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        logger.info(
            "compiling the CPU decode graph in the background (%s); decoding is eager until then", self.path
        )

    def _load(self) -> None:
        try:
            self._run = torch._inductor.aoti_load_package(str(self.path)).loader.run
            self.state = "loaded"
        except Exception as e:  # a damaged or foreign file: eager from now on
            self.state = "failed"
            logger.warning("the CPU decode graph %s does not load (%s); decoding stays eager", self.path, e)

    def ready(self) -> bool:
        """Whether the graph runs now (a build that has ended is loaded here)."""
        if self._run is not None or self._proc is None or self._proc.poll() is None:
            return self._run is not None
        rc, self._proc = self._proc.returncode, None
        torch.set_num_threads(self._threads)
        if rc == 0 and self.path.exists():
            self._load()
        else:
            self.state = "failed"
            self.path.with_suffix(".failed").write_text(f"exit {rc}; see {self.log.name}\n")
            logger.warning(
                "the CPU decode graph's build failed (exit %s, %s); decoding stays eager", rc, self.log
            )
        return self._run is not None

    def wait(self, limit_s: float | None = None) -> str:
        """Wait for a build to end (at most `limit_s`); the state then."""
        deadline = None if limit_s is None else time.monotonic() + limit_s
        while self.state == "building" and not self.ready():
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return self.state

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor | None:
        """The final hidden rows of a step whose sequences each bring one new token, or None (run it eagerly):
        another step, or no graph yet."""
        t = input_ids.shape[0]
        if t != meta.query_start_loc.shape[0] - 1 or not self.ready():
            return None
        bs = self.spec.block_size
        slots = meta.slot_mapping.long()
        lens = meta.seq_lens
        length = meta.max_seq_len or int(lens.max())
        ctx = ops._context_slots(meta.block_tables, length, bs)
        x = self.model.embed_tokens(input_ids)
        steps = [
            x,
            positions.to(torch.int32),
            lens.to(torch.int32),
            slots // bs,
            slots % bs,
            ctx // bs,
            ctx % bs,
        ]
        return self._run(steps + self._held)[0]

    def close(self) -> None:
        """Stop a build still running, with inductor's compile workers, and remove its partial file."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)  # the build and inductor's compile workers
            self._proc.wait()
            _part(self.path, self._proc.pid).unlink(missing_ok=True)
            torch.set_num_threads(self._threads)
        self._proc = None
        self._run = None


def start(model: torch.nn.Module, kv_cache: torch.Tensor) -> CpuGraph | None:
    """The graph for this model and cache, or None where it does not take them, is turned off, or no C++
    compiler is installed (inductor needs one; the lean install has none)."""
    if not enabled():
        return None
    spec = spec_of(model, kv_cache)
    if spec is None:
        return None
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        logger.info("no C++ compiler: the CPU decode graph cannot be built; decoding stays eager")
        return None
    return CpuGraph(model, kv_cache, spec, graph_dir() / f"{spec.key()}.pt2")


def _watch(engine: int) -> None:
    """End the build, with its compile workers (its process group), once the engine that started it is gone."""
    while os.getppid() == engine:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    """`python -m tinypaged.model.cpu_graph SPEC_JSON OUT [ENGINE_PID]`: the background build. It ends with the
    engine that started it, runs after the engine's work (nice 10), and one build of a file runs at a time:
    another engine's build of the same file waits for it, then finds the file and stops."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 2:
        threading.Thread(target=_watch, args=(int(args[2]),), daemon=True).start()
    os.nice(10)
    out = Path(args[1])
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            build(Spec.from_json(Path(args[0]).read_text()), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
