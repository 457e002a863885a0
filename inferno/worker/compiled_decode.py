"""The CPU decode step compiled ahead of time: two graphs (one sequence; small batches; two more with LoRA adapters)
captured by dynamo and built by inductor once (`torch.compile(...).aot_compile`), then saved as a precompiled artifact, so a later start loads
them without tracing the model, building guards or looking anything up in inductor's caches.

The graphs take the model and its attention backend as arguments: the weights and KV caches are inputs, read from
the objects given at every call, not constants. Only the batch size and the block-table width are dynamic;
everything else, the KV caches included, is static (their block capacity stays the same from start to start:
`stable_block_capacity`; with `dynamic=True` their sizes became symbols: 486 shape guards checked at every step,
0.3 ms, and a slower batch graph). Only the guards on the step's own tensors (dtypes, the batch size and block-table
width, the row counts where quantized layers switch kernels) are kept and checked at every call; a step that fails
them runs eagerly. What the dropped guards would have checked (the modules, their tensors' shapes, the globals, the
code) is in the artifact's key instead (`compile_cache.precompiled_key`). The layers call the same native kernels
traced as eager (layers/fused_cpu.py: looked up before the trace), so both paths give the same bits."""
import functools
import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from inferno.layers.fused_cpu import resolve_fused_ops
from inferno.layers.lora import LoRAMapping, LoRAStack
from inferno.worker.compile_cache import compile_cache_hits

logger = logging.getLogger("inferno")

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
# the graphs, by name: (batch size they are traced with, whether their rows run LoRA adapters). A batch of one is
# always specialised by dynamo; any other batch size is a symbol. A model with LoRA stacks (model/lora.py) gets two
# more, whose steps name each row's adapter slot (an input: changing adapters recompiles nothing).
GRAPHS = {"one sequence": (1, False), "batches": (2, False)}
LORA_GRAPHS = {"one sequence with LoRA adapters": (1, True), "batches with LoRA adapters": (2, True)}
# traces of one graph at most, where floats are specialised one by one (aot_compile)
MAX_RESTARTS = 8
# the phases of a compile logged, by dynamo's timers (torch._dynamo.utils.compilation_time_metrics); the rest of it
# is dynamo's tracing and guards (not timed apart by the AOT compile)
PHASES = {"inductor": "compile_fx.<locals>.fw_compiler_base", "cpp": "PyCodeCache.load_by_key_path"}


def decode_step(model: torch.nn.Module, attention, input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                lora_slots: torch.Tensor | None = None) -> torch.Tensor:
    """The model over one decode token per request (what gets compiled); `lora_slots`: each row's adapter slot."""
    lora = None if lora_slots is None else LoRAMapping(lora_slots)
    return model(input_ids, positions, attention.decode_metadata(slot_mapping, block_tables, seq_lens), lora=lora)


def graphs_of(model: torch.nn.Module) -> dict[str, tuple[int, bool]]:
    return GRAPHS | (LORA_GRAPHS if any(isinstance(m, LoRAStack) for m in model.modules()) else {})


def compile_options() -> dict:
    """Inductor's options for the graphs: fused elementwise code and a C++ wrapper (its ~8 kernel and operator calls
    per layer cost no Python, about 5-10 % of a SmolLM2 decode step on 2 AVX2 cores), loops parallel over the serving
    thread's count, the vector width named (`vector_width_option`). The wrapper (straight-line calls: SmolLM2's is
    thousands of lines in one function) is built apart from the fused kernels, at -O1 instead of their -O3, and
    without precompiled headers (NO_PRECOMPILED_HEADERS)."""
    return {"emulate_precision_casts": True, "cpp_wrapper": True, "cpp.threads": torch.get_num_threads(),
            "cpp_wrapper_build_separate": True, **NO_PRECOMPILED_HEADERS, **vector_width_option()}


# Inductor precompiles torch's headers into /tmp, outside the compile cache, and every process that builds or even
# loads a library preprocesses them again to check that file (g++ -E, seconds): one graph's build gains less than
# that costs, and loading a precompiled step needs no header at all.
NO_PRECOMPILED_HEADERS = {"cpp_cache_precompile_headers": False}


def import_compiler() -> None:
    """What loading a precompiled step (or compiling one) imports: dynamo's AOT compile, AOTAutograd's and inductor's
    caches, inductor itself (`compile_options`, which also runs its ISA probe)."""
    import torch._dynamo.aot_compile  # noqa: F401
    import torch._functorch._aot_autograd.aot_autograd_result  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.output_code  # noqa: F401
    compile_options()


def vector_width_option() -> dict[str, int]:
    """Inductor's vector width for CPU code, as it would pick it (ATEN_CPU_CAPABILITY, else the CPU's widest), set
    explicitly: its compile cache is keyed by its configuration but not by that choice, so a process capped at AVX2
    (INFERNO_CPU_ISA=avx2 with PyTorch's caps) and one that is not shared entries, and an AVX-512 process that loaded
    a graph compiled for 256-bit vectors corrupted its heap (a malloc abort in the first compiled step)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    width = pick_vec_isa().bit_width()
    return {"cpp.simdlen": width} if width else {}


def scratch_inputs(batch: int, scratch_block: int, block_size: int, lora: bool = False) -> Inputs:
    """A decode step of `batch` rows that writes only the scratch block (three-block tables: equal sizes would be
    tied together by dynamo); with `lora`, every row on slot 0 (no adapter: the products stay zero)."""
    return (torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long),
            torch.full((batch,), scratch_block * block_size), torch.full((batch, 3), scratch_block),
            torch.ones(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long) if lora else None)


@dataclass
class CompiledDecode:
    """The compiled graphs by name (GRAPHS) and how many steps ran on them or, failing their guards, eagerly."""
    graphs: dict[str, object]  # torch._dynamo.aot_compile.AOTCompiledFunction
    num_compiled_steps: int = 0
    num_eager_steps: int = 0
    serialized: dict[str, bytes] = field(default_factory=dict, repr=False)  # for the compile cache, once

    def run(self, model: torch.nn.Module, attention, input_ids: torch.Tensor, positions: torch.Tensor,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            lora_slots: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's hidden states from the graph for its batch size; None where its guards fail (a batch beyond
        the row counts where quantized layers switch kernels, e.g. int4 dequantizes from 96 rows): the caller runs
        it eagerly instead of compiling more graphs mid-serving."""
        if block_tables.shape[1] == 1:  # width 1 would be specialised: pad with an unread block
            block_tables = torch.cat([block_tables, block_tables], dim=1)
        name = "one sequence" if input_ids.shape[0] == 1 else "batches"
        graph = self.graphs[name if lora_slots is None else f"{name} with LoRA adapters"]
        args = (model, attention, input_ids, positions, slot_mapping, block_tables, seq_lens, lora_slots)
        if not graph.guard_check(*args):
            self.num_eager_steps += 1
            return None
        self.num_compiled_steps += 1
        return graph.fn(*args)


def compile_graphs(model: torch.nn.Module, attention, scratch_block: int, block_size: int) -> CompiledDecode:
    """Both graphs traced and built (from inductor's caches where it has them), each logged with its phases (dynamo's
    timers). The fused elementwise kernels are looked up first: the graphs call the ones the eager steps call.

    Dynamo's automatic dynamic shapes are off: `decode_step` is one function for every model of the process, and
    with them a draft model's trace after its target's took every size that differed between the two as a symbol
    (its graphs traced twice, 25-31 s each instead of 4-7, and built for symbolic shapes)."""
    resolve_fused_ops()
    with fx_patches_on_this_thread_only(), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        return _compile_graphs(model, attention, scratch_block, block_size)


def _compile_graphs(model: torch.nn.Module, attention, scratch_block: int, block_size: int) -> CompiledDecode:
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=None,
                             options={"guard_filter_fn": serializable_step_guards, **compile_options()})
    graphs, serialized = {}, {}
    for name, (batch, lora) in graphs_of(model).items():
        inputs = scratch_inputs(batch, scratch_block, block_size, lora)
        torch._dynamo.maybe_mark_dynamic(inputs[3], 1)
        if batch > 1:
            for t in inputs:
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        start, hits, before = time.perf_counter(), compile_cache_hits(), phase_seconds()
        graph = aot_compile(compiled, (model, attention, *inputs))
        seconds = time.perf_counter() - start
        serialized[name] = graph.serialize(graph).serialized_data
        graph.disable_guard_check()  # CompiledDecode.run checks them, and runs a failing step eagerly
        graphs[name] = graph
        phases = {key: value - before[key] for key, value in phase_seconds().items()}
        logger.info("decode graph for %s compiled in %.1f s: tracing and guards %.1f s, inductor %.1f s (its C++ "
                    "built and loaded %.1f s; %s)", name, seconds, seconds - phases["inductor"], phases["inductor"],
                    phases["cpp"], "from inductor's cache" if compile_cache_hits() > hits else "generated")
    return CompiledDecode(graphs, serialized=serialized)


def aot_compile(compiled, args: tuple):
    """`compiled.aot_compile` of `args`, traced again where AOTAutograd asks for a Python float to be specialised
    (a scale of the Q4_K layers, say): dynamo's own compiles restart so, its AOT one raises instead (the float is
    marked by then, so the next trace specialises it)."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    for _ in range(MAX_RESTARTS):
        try:
            return compiled.aot_compile((args, {}))
        except TensorifyScalarRestartAnalysis:
            logger.info("decode graph: a float specialised, tracing again")
    return compiled.aot_compile((args, {}))


def phase_seconds() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics
    return {name: sum(compilation_time_metrics.get(key, ())) for name, key in PHASES.items()}


def load_graphs(serialized: dict[str, bytes]) -> CompiledDecode:
    """The graphs of a precompiled artifact (raises where it cannot be used: another torch or Python, a damaged
    entry). Their C++ libraries come from inductor's cache folder (built again where missing)."""
    import torch._inductor.config
    from torch._dynamo.aot_compile import AOTCompiledFunction
    # the guards' state names the native operators' namespace as a module, which unpickling imports by name
    sys.modules.setdefault("torch.ops.inferno", torch.ops.inferno)
    graphs = {}
    with torch._inductor.config.patch(NO_PRECOMPILED_HEADERS):
        for name in serialized:
            graphs[name] = AOTCompiledFunction.deserialize(serialized[name])
            graphs[name].disable_guard_check()
    return CompiledDecode(graphs)


def warm_up_graphs(compiled: CompiledDecode, model: torch.nn.Module, attention, scratch_block: int,
                   block_size: int) -> None:
    """Each graph run once on the scratch block (its library loaded, its first-call work done before serving); raises
    where a graph fails or does not take the step it was made for."""
    for name, (batch, lora) in graphs_of(model).items():
        for rows in (batch,) if batch == 1 else (batch, batch + 1):  # the batch graph: any size
            if compiled.run(model, attention, *scratch_inputs(rows, scratch_block, block_size, lora)) is None:
                raise RuntimeError(f"the compiled decode graph for {name} rejects a step of {rows} rows")
    compiled.num_compiled_steps = 0


def serializable_step_guards(entries: list) -> list[bool]:
    """The guards a precompiled graph keeps: none on the modules (their weights and caches are the same tensors for
    the runner's lifetime, and their shapes are in the artifact's key), on globals (module-level constants, and the
    code, are in the key too) or of the kinds that cannot be saved (object identities); those on the step's
    tensors stay."""
    from torch._dynamo.guards import CheckFunctionManager
    unsavable = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    global_names = torch.compiler.skip_guard_on_globals_unsafe(entries)
    return [m and g and e.guard_type not in unsavable and not unsavable.intersection(e.derived_guard_types or ())
            for m, g, e in zip(modules, global_names, entries)]


@contextmanager
def fx_patches_on_this_thread_only() -> Iterator[None]:
    """While FX traces (AOTAutograd's make_fx, inductor's pattern tracing) it patches `torch.nn.Module.__call__` and
    `__getattr__` for the whole process; the serving thread's eager steps then ran through the tracer and failed
    ("module is not installed as a submodule"), ending their requests. Within this context the methods FX patches
    act as the tracer's only on the thread that entered it, and as the originals on every other thread."""
    from torch.fx._symbolic_trace import _Patcher
    owner, patch_method = threading.get_ident(), _Patcher.patch_method

    def patch_for_owner(self, cls: type, name: str, new_fn, deduplicate: bool = True) -> None:
        original = getattr(cls, name)

        @functools.wraps(new_fn)
        def on_owner_only(*args, **kwargs):
            return (new_fn if threading.get_ident() == owner else original)(*args, **kwargs)
        patch_method(self, cls, name, on_owner_only, deduplicate)

    _Patcher.patch_method = patch_for_owner
    try:
        yield
    finally:
        _Patcher.patch_method = patch_method
