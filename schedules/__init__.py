"""How the kernels are scheduled (installed as ``tvm_deform.schedules``): one module per target
family and kernel (:mod:`.cpu`, :mod:`.cpu_backward`, :mod:`.cuda`, :mod:`.cuda_backward`,
:mod:`.cuda_tensor_core`), what they share (:mod:`.common`, :mod:`.rule`), and the registry
below.

A rule (:class:`.rule.Rule`) is one structure of one kernel on one kind of target, in the manner
of TVM's dlight rules: ``apply(func, target, tunable)`` gives its default schedule
(``tunable=False``) or its MetaSchedule design space (``tunable=True``) from the same code, and
None where it does not take ``func``. :data:`RULES` lists them once, in order: the default
schedule of a kernel is the first default rule that takes the PrimFunc (:func:`apply_default`);
its tuning space is the design spaces of every rule that takes it (:func:`design_spaces`).
:func:`forward_schedule` is the forward's default schedule; :func:`tensor_core_schedule` puts a
half-precision layer on tensor cores (:mod:`.cuda_tensor_core`), which is not the default."""

from __future__ import annotations

import functools

from tvm import IRModule, s_tir, tirx
from tvm.s_tir.schedule import Instruction, Trace
from tvm.target import Target
from tvm_deform.schedules.common import lanes
from tvm_deform.schedules.cpu import FORWARD_RULES as CPU_FORWARD_RULES
from tvm_deform.schedules.cpu import pixel_classes as cpu_pixel_classes
from tvm_deform.schedules.cpu import pixel_quantum as cpu_pixel_quantum
from tvm_deform.schedules.cpu_backward import (
    BackwardCPU,
    GradInputCPU,
    columns_fit_vectors,
    dense_weight_along_channels,
    grad_input_block,
)
from tvm_deform.schedules.cuda import (
    OnePassCUDA,
    PipelinedCUDA,
    SampleOnceCUDA,
    SplitReductionCUDA,
    WideTileCUDA,
)
from tvm_deform.schedules.cuda_backward import BackwardCUDA, GradInputCUDA
from tvm_deform.schedules.cuda_tensor_core import MIN_ARCH as TENSOR_CORE_MIN_ARCH
from tvm_deform.schedules.cuda_tensor_core import SampleOnceTensorCoreCUDA, TensorCoreCUDA
from tvm_deform.schedules.rule import Rule, answers_given

from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape

#: every rule, in the order the default tries them for a (kernel, target kind): depthwise
#: layers inline their samples, small weights on large maps vectorise along the output
#: channels, the rest take the column tiles; on a GPU, the columns are sampled once and
#: multiplied by a GEMM (its reduction split over thread blocks where the output tiles alone
#: would not fill the GPU), and the fused structures are design spaces
RULES: tuple[Rule, ...] = (
    *CPU_FORWARD_RULES,
    BackwardCPU(),
    GradInputCPU(),
    SampleOnceCUDA(),
    WideTileCUDA(),
    PipelinedCUDA(),
    SplitReductionCUDA(),
    OnePassCUDA(),
    TensorCoreCUDA(),
    SampleOnceTensorCoreCUDA(),
    BackwardCUDA(),
    GradInputCUDA(),
)


def rules_for(kernel: str, target: Target) -> list[Rule]:
    """The rules of ``kernel`` ("forward", "backward", "grad_input") for ``target``'s kind, in
    order."""
    return [r for r in RULES if r.kernel == kernel and r.target_kind == target.kind.name]


def apply_default(kernel: str, func: tirx.PrimFunc, target: Target) -> s_tir.Schedule:
    """``func`` (the PrimFunc of ``kernel``) under the first default rule for ``target``'s kind
    that takes it."""
    rules = [r for r in rules_for(kernel, target) if r.default]
    if not rules:
        raise NotImplementedError(f"no default {kernel} schedule for {target.kind.name}")
    for rule in rules:
        sch = rule.apply(func, target)
        if sch is not None:
            return sch
    raise RuntimeError(f"no {kernel} schedule applies to this {target.kind.name} PrimFunc")


def design_spaces(kernel: str, func: tirx.PrimFunc, target: Target) -> list[s_tir.Schedule]:
    """The MetaSchedule design spaces of ``func`` (the PrimFunc of ``kernel``) on ``target``:
    every rule's space that takes it, in :data:`RULES` order."""
    return [space for _, space in named_design_spaces(kernel, func, target)]


def named_design_spaces(
    kernel: str, func: tirx.PrimFunc, target: Target
) -> list[tuple[str, s_tir.Schedule]]:
    """:func:`design_spaces`, each with the name of the rule that gave it. A space as returned
    is its rule's own schedule (every sampled tile size at the rule's value)."""
    spaces: list[tuple[str, s_tir.Schedule]] = []
    for rule in rules_for(kernel, target):
        space = rule.apply(func, target, tunable=True)
        for sch in space if isinstance(space, list) else [space]:
            if sch is not None:
                spaces.append((repr(rule), sch))
    return spaces


def pixel_classes(shape: ConvShape, target: Target) -> tuple[int, ...]:
    """The pixel counts from which ``shape``'s default forward on ``target`` changes structure
    (see :func:`.cpu.pixel_classes` and :meth:`.cuda.SampleOnceCUDA.pixel_classes`); one
    class, ``(1,)``, where it never does."""
    if target.kind.name == "llvm":
        return cpu_pixel_classes(shape, target)
    return _gpu_pixel_classes(shape.any_size(), target)


@functools.lru_cache(maxsize=256)
def _gpu_pixel_classes(layer: ConvShape, target: Target) -> tuple[int, ...]:
    # Once per layer: it builds the PrimFunc (20 ms), which a new size must not pay again.
    return SampleOnceCUDA().pixel_classes(_any_size_definition(layer, target), target)


def any_size_quantum(shape: ConvShape, target: Target, min_pixels: int) -> int:
    """The multiple the forward for any size of ``shape``'s layer pads its pixel axis to, in
    the size class from ``min_pixels`` (see :func:`pixel_classes`): the CPU's pixel tile, or
    ``PIXEL_QUANTUM`` (the GEMM's pixel tile) on a GPU."""
    if target.kind.name == "llvm":
        return cpu_pixel_quantum(shape, target, min_pixels)
    return definition.PIXEL_QUANTUM


def _any_size_definition(
    shape: ConvShape,
    target: Target,
    layout: str = "NCHW",
    min_pixels: int = 1,
    quantum: int | None = None,
) -> tirx.PrimFunc:
    return definition.forward(
        shape,
        layout,
        pixel_quantum=quantum or any_size_quantum(shape, target, min_pixels),
        sizes="symbolic",
        min_pixels=min_pixels,
        # A CPU's tiles copy their offsets and masks to stages read by vector loads; a GPU
        # thread reads its pixel's at a clamped index.
        staged_inputs=target.kind.name == "llvm",
    )


def backward_pixel_quantum(shape: ConvShape, target: Target) -> int:
    """The multiple the backward kernels for any size of ``shape``'s layer pad the pixels to.
    On a CPU, four vectors of the accumulator where the gradient of a dense weight is summed
    along the channels in tiles of pixels (:func:`dense_weight_along_channels`), which then
    take four vectors of pixels (a training step of the R50 layers took 0.89-0.93x its time
    with tiles of two, on a Zen 4; the depthwise weight gradient's tiles gained nothing), else
    two vectors, the widest tile of the other stages. On a GPU the column gradient's pixel
    tile."""
    if target.kind.name == "cuda":
        threads, registers = BackwardCUDA.column_tiles[0]
        return threads * registers
    vector = lanes(target, shape.accumulator_dtype)
    return (4 if dense_weight_along_channels(shape, vector) else 2) * vector


def grad_input_channel_block(shape: ConvShape, target: Target) -> int:
    """The channels whose input-gradient planes one block of the CPU's scatter fills at once
    (``definition.grad_input(..., channel_block=...)``); 1 off a CPU (a GPU gathers by tiles:
    :func:`grad_input_definition`)."""
    if target.kind.name != "llvm":
        return 1
    return grad_input_block(shape, target)


def grad_input_definition(
    shape: ConvShape, target: Target, sizes: str = "static", quantum: int = definition.PIXEL_QUANTUM
) -> tirx.PrimFunc:
    """The PrimFunc of the input's gradient of ``shape`` on ``target`` (``sizes`` and the pixel
    ``quantum`` as for ``definition.backward``): on a CPU the scatter, a block per plane (or
    per vector of channels, reading the column gradient as the backward lays it out); on a GPU
    the gather, a thread block per tile of a plane (``definition.grad_input_tiles``), since a
    thread per plane would leave most of the GPU idle."""
    if target.kind.name != "llvm":
        return definition.grad_input_tiles(shape, sizes, quantum)
    block = grad_input_channel_block(shape, target)
    channels_last = channels_last_columns(shape, target)
    return definition.grad_input(shape, sizes, quantum, block, channels_last)


def channels_last_columns(shape: ConvShape, target: Target) -> bool:
    """Whether the backward kernels of ``shape`` on ``target`` lay the column gradient out
    channels-last, ``[n, p, k * channels + c]`` (on a CPU where two or more vectors fill the
    channels of an offset group), which the input's scatter then reads so
    (``definition.grad_input(..., channels_last_columns=True)``); else ``[n, c, k, p]``."""
    if target.kind.name != "llvm":
        return False
    vector = lanes(target, shape.accumulator_dtype)
    return columns_fit_vectors(shape.in_channels, shape.offset_groups, vector)


def forward_schedule(
    shape: ConvShape, target: Target, layout: str = "NCHW", min_pixels: int | None = None
) -> s_tir.Schedule:
    """The default schedule of ``shape``'s forward for ``target``: the first default rule of
    the definition; with ``min_pixels``, of the PrimFunc for any size (batch, height and width
    symbolic) whose maps have at least that many pixels (see :func:`pixel_classes`). float16
    and bfloat16 layers compute on the CUDA cores too (columns and sums in float32): on an H200
    the fused tensor-core schedule (``TensorCoreCUDA``) was slower than the CUDA-core one on 11
    of the 14 suite layers it takes, and the one that replaced it
    (:func:`tensor_core_schedule`) is untimed."""
    if min_pixels is None:
        return apply_default("forward", definition.forward(shape, layout), target)
    return apply_default("forward", _any_size_definition(shape, target, layout, min_pixels), target)


def replayed_any_size_schedule(
    shape: ConvShape, target: Target, min_pixels: int, tuned: tirx.PrimFunc, trace: s_tir.Trace
) -> s_tir.Schedule | None:
    """``trace``, a tuned schedule of ``tuned`` (the forward PrimFunc of one size of
    ``shape``'s layer, postprocessing included), for the forward for any size of the layer in
    the size class from ``min_pixels`` (see :func:`forward_schedule`; :func:`replayed`), or
    None where it does not carry over.

    On a CPU, the PrimFunc for any size pads its pixels to a multiple of the rule's pixel tile,
    which fixes that tile (see :class:`.cpu.ForwardCPU`): a derived kernel takes the tile the
    record chose by padding to it instead of the size class's default tile, where its rule
    then takes that tile (on a Zen 4, a column-tile record tuned with a tile of 16 ran
    0.92-0.97x the default's time so, 1.01-1.05x with the default's tile of 32)."""
    layer = shape.any_size()
    matched = _match("forward", tuned, target, trace)
    if matched is None:
        return replay(_any_size_definition(layer, target, "NCHW", min_pixels), trace)
    rule, variant, values = matched
    tile = values[0] if values and target.kind.name == "llvm" else None
    if isinstance(tile, int) and tile != any_size_quantum(layer, target, min_pixels):
        padded = _any_size_definition(layer, target, "NCHW", min_pixels, quantum=tile)
        derived = _answer(rule, variant, values, padded, target)
        if derived is not None and derived[1][:1] == [tile]:
            return derived[0]
    func = _any_size_definition(layer, target, "NCHW", min_pixels)
    derived = _answer(rule, variant, values, func, target)
    return derived[0] if derived is not None else replay(func, trace)


def replayed(
    kernel: str, func: tirx.PrimFunc, target: Target, tuned: tirx.PrimFunc, trace: s_tir.Trace
) -> s_tir.Schedule | None:
    """``trace``, a tuned schedule of ``tuned`` (a PrimFunc of ``kernel`` of one size), for
    ``func``, the PrimFunc of the same layer for any size: derived (:func:`derive`: the rule
    that gave it, applied to ``func`` with its choices) where it is of one of the rules'
    design spaces, else its steps replayed (:func:`replay`: a record of another design space,
    e.g. tuned by another version); None where neither takes ``func``."""
    derived = derive(kernel, func, target, tuned, trace)
    return derived if derived is not None else replay(func, trace)


def derive(
    kernel: str, func: tirx.PrimFunc, target: Target, tuned: tirx.PrimFunc, trace: s_tir.Trace
) -> s_tir.Schedule | None:
    """``func`` (a PrimFunc of ``kernel`` for any size) under the rule that gave ``trace``,
    with the tile sizes ``trace`` chose: ``trace`` is a tuned schedule of ``tuned``, a
    PrimFunc of one size of the same layer, from one of the design spaces of that PrimFunc
    (:func:`named_design_spaces`) with its sampled choices. The same rule's design space of
    ``func`` then answers each of its questions as ``trace`` answered it (a rule asks them in
    the same order at every size), or where that value is not valid for ``func`` (e.g. a
    tile that does not divide the pixels' quantum), as its default does. Unlike
    :func:`replay`, the result is the rule's own schedule of ``func``: its stages and index
    arithmetic for any size, with the tuned numbers. None where ``trace`` is of no design
    space of ``tuned`` (tuned by another version of the rules, or postprocessing aside, not
    a design space's schedule), the rule offers no such space of ``func``, or its space of
    ``func`` asks another number of questions. The record's postprocessing is not carried
    over: the kernel is the rule's schedule, as the default's is."""
    matched = _match(kernel, tuned, target, trace)
    if matched is None:
        return None
    derived = _answer(*matched, func, target)
    return None if derived is None else derived[0]


def _match(
    kernel: str, tuned: tirx.PrimFunc, target: Target, trace: s_tir.Trace
) -> tuple[Rule, int, list[int | None]] | None:
    """The rule whose design space of ``tuned`` gave ``trace``, which of its spaces, and the
    value ``trace`` chose for each of its questions; None where ``trace`` is of none (see
    :func:`derive`)."""
    with answers_given() as asked:
        spaces = named_design_spaces(kernel, tuned, target)
    matches = []
    for index, (name, space) in enumerate(spaces):
        matched = _values_chosen(space, asked(space), trace)
        if matched is not None:
            variant = [other for other, _ in spaces[:index]].count(name)
            steps, values = matched
            matches.append((steps, -index, name, variant, values))
    if not matches:
        return None
    # the space with the most steps the trace begins with; of equals, the first in RULES
    *_, name, variant, values = max(matches, key=lambda match: match[:2])
    rule = next(rule for rule in rules_for(kernel, target) if repr(rule) == name)
    return rule, variant, values


def _answer(
    rule: Rule, variant: int, values: list[int | None], func: tirx.PrimFunc, target: Target
) -> tuple[s_tir.Schedule, list] | None:
    """``func`` under ``rule``'s ``variant``-th design space of it with its questions answered
    by ``values`` (see :func:`_answered`), and the answers that gave; None where the rule
    offers no such space of ``func``."""
    with answers_given() as asked:
        try:
            found = rule.apply(func, target, tunable=True)
        except (ValueError, TypeError, RuntimeError):  # the rule does not take func as a space
            return None
    found = found if isinstance(found, list) else [found] if found is not None else []
    if variant >= len(found):
        return None
    return _answered(func, found[variant], asked(found[variant]), values)


def _values_chosen(
    space: s_tir.Schedule, answers: list, trace: s_tir.Trace
) -> tuple[int, list[int | None]] | None:
    """How many of ``trace``'s steps are ``space``'s, and the value ``trace`` chose for each
    of ``answers`` (the answers ``space``'s rule gave, in order; see :func:`answers_given`);
    None where ``trace`` does not begin with ``space``'s steps, its sampled choices aside: as
    the rule made them (a seed of a tuning round), or without the steps whose results nothing
    uses (MetaSchedule's search keeps its traces so). The steps that follow are taken for
    postprocessing, marked as such or not."""
    if not _every_sample_answers(space, answers):
        return None
    for steps in (space.trace.insts, space.trace.simplified(remove_postproc=True).insts):
        values = _values_in(list(steps), answers, trace)
        if values is not None:
            return len(steps), values
    return None


def _every_sample_answers(space: s_tir.Schedule, answers: list) -> bool:
    """Whether every ``sample_categorical`` of ``space`` is one of ``answers`` (its rule asked
    every choice through :class:`.rule.Choices`, on this schedule)."""
    sampled = sum(not isinstance(answer, int) for answer in answers)
    return sampled == sum(inst.kind.name == "SampleCategorical" for inst in space.trace.insts)


def _values_in(
    steps: list[Instruction], answers: list, trace: s_tir.Trace
) -> list[int | None] | None:
    """:func:`_values_chosen` for one form of the space's ``steps``."""
    theirs = list(trace.insts)[: len(steps)]
    if len(theirs) < len(steps):
        return None
    if any(a.kind.name != b.kind.name for a, b in zip(steps, theirs, strict=True)):
        return None
    samples = [inst for inst in steps if inst.kind.name == "SampleCategorical"]
    chosen = [inst for inst in theirs if inst.kind.name == "SampleCategorical"]
    if any(inst not in trace.decisions for inst in chosen):
        return None
    decisions = {mine: trace.decisions[inst] for mine, inst in zip(samples, chosen, strict=True)}
    kept = {inst: trace.decisions[inst] for inst in chosen}
    if Trace(steps, decisions).as_python() != Trace(theirs, kept).as_python():
        return None
    values = []
    for answer in answers:
        sample = None if isinstance(answer, int) else _sample_of(samples, answer)
        if sample is None:  # one valid value, or a choice that nothing used
            values.append(answer if isinstance(answer, int) else None)
        else:
            values.append(int(sample.attrs[0][int(decisions[sample])]))
    return values


def _sample_of(samples: list[Instruction], answer) -> Instruction | None:
    """The one of ``samples`` (``SampleCategorical`` steps) that gave ``answer``, if any."""
    return next((inst for inst in samples if inst.outputs[0].same_as(answer)), None)


def _answered(
    func: tirx.PrimFunc, space: s_tir.Schedule, answers: list, values: list[int | None]
) -> tuple[s_tir.Schedule, list[int]] | None:
    """``func`` under ``space``'s steps with each of its ``answers`` set to the corresponding
    of ``values`` where that value is among its candidates (its own decision otherwise), and
    the value each question took; None where the two lists differ in length."""
    if len(answers) != len(values) or not _every_sample_answers(space, answers):
        return None
    steps = space.trace.insts
    samples = [inst for inst in steps if inst.kind.name == "SampleCategorical"]
    decisions = dict(space.trace.decisions.items())
    taken = []
    for answer, value in zip(answers, values, strict=True):
        sample = None if isinstance(answer, int) else _sample_of(samples, answer)
        if sample is None:
            taken.append(answer)
            continue
        candidates = [int(c) for c in sample.attrs[0]]
        if value in candidates:
            decisions[sample] = candidates.index(value)
        taken.append(candidates[int(decisions[sample])])
    sch = s_tir.Schedule(func)
    Trace(steps, decisions).apply_to_schedule(sch, remove_postproc=True)
    return sch, taken


def other_choices(mod: IRModule, space: s_tir.Schedule) -> s_tir.Trace:
    """The trace of ``space`` (a design space of ``mod``, as its rule gave it) with each
    sampled choice moved from the rule's own candidate to the one before it (the first to the
    last): a schedule of the same space that is not the default, e.g. to check that a tuned
    record's choices carry over."""
    decisions = {
        inst: (int(decision) - 1) % len(inst.attrs[0])
        for inst, decision in space.trace.decisions.items()
    }
    if not decisions:
        raise ValueError("a design space with no choices")
    sch = s_tir.Schedule(mod)
    Trace(space.trace.insts, decisions).apply_to_schedule(sch, remove_postproc=False)
    return sch.trace


def replay(func: tirx.PrimFunc, trace: s_tir.Trace) -> s_tir.Schedule | None:
    """``trace``, a tuned schedule of a PrimFunc of one size, replayed on ``func``, the same
    computation for any size (sizes symbolic), or None where it does not replay there.

    The rules split every loop over a symbolic extent with one factor left to TVM
    (``[None, f]``), so a replayed split covers any extent (TVM predicates a ragged tile) and
    the kernel computes the same function, with the tile sizes tuned at that one size. One
    step may not replay: a ``decompose_reduction`` of a block whose bindings a symbolic size
    makes non-affine (the sum of a split reduction's parts, its outputs' fused index divided
    by ``h * w``). Such a step is left out where nothing later uses what it made: TVM's
    lowering then initialises those sums itself, as it does in the default kernels for any
    size."""
    instructions = list(trace.insts)
    decisions = dict(trace.decisions.items())
    while True:
        failed = _first_failing(func, instructions, decisions)
        if failed is None:
            sch = s_tir.Schedule(func)
            Trace(instructions, decisions).apply_to_schedule(sch, remove_postproc=False)
            return sch
        step = instructions[failed]
        later = [rv for inst in instructions[failed + 1 :] for rv in inst.inputs]
        if step.kind.name != "DecomposeReduction" or any(
            out.same_as(rv) for out in step.outputs for rv in later
        ):
            return None
        del instructions[failed]


def _first_failing(
    func: tirx.PrimFunc, instructions: list[Instruction], decisions: dict
) -> int | None:
    """The index of the first of ``instructions`` that fails to replay on ``func`` (TVM's
    errors: a block or loop it names is not there, a primitive's condition not met), or None
    where they all replay. Bisects over prefixes: a trace replays in milliseconds."""

    def replays(count: int) -> bool:
        prefix = instructions[:count]
        members = set(prefix)
        kept = {inst: decision for inst, decision in decisions.items() if inst in members}
        try:
            Trace(prefix, kept).apply_to_schedule(s_tir.Schedule(func), remove_postproc=False)
        except Exception:  # noqa: BLE001 - any of TVM's errors: the step does not replay here
            return False
        return True

    if replays(len(instructions)):
        return None
    good, bad = 0, len(instructions)  # a prefix of ``good`` replays, of ``bad`` does not
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if replays(middle) else (good, middle)
    return bad - 1


def tensor_core_schedule(
    shape: ConvShape, target: Target, layout: str = "NCHW", min_pixels: int | None = None
) -> s_tir.Schedule | None:
    """``shape``'s forward on tensor cores (:class:`.cuda_tensor_core.SampleOnceTensorCoreCUDA`,
    on the definition whose sampled columns are rounded to the layer's float16 or bfloat16,
    which a tensor core multiplies; float32 accumulation), or None where the rule does not take
    the layer. float32 never runs on tensor cores (no TF32). With ``min_pixels``, the kernel for
    any size of the layer in the size class from ``min_pixels`` (see
    :func:`tensor_core_pixel_classes`)."""
    func = _tensor_core_definition(shape, target, layout, min_pixels)
    return None if func is None else SampleOnceTensorCoreCUDA().apply(func, target)


def tensor_cores_take(
    shape: ConvShape, target: Target, layout: str = "NCHW", any_size: bool = False
) -> bool:
    """Whether :func:`tensor_core_schedule` has a schedule for ``shape`` on ``target``: for
    its own size, or with ``any_size`` for every size of its layer (which also takes maps whose
    pixels are not a multiple of a fragment, e.g. 7x7: they are padded)."""
    func = _tensor_core_definition(shape, target, layout, 1 if any_size else None)
    return func is not None and SampleOnceTensorCoreCUDA().takes(func, target)


def tensor_core_pixel_classes(shape: ConvShape, target: Target) -> tuple[int, ...]:
    """The size classes of :func:`tensor_core_schedule`'s kernels for any size of ``shape``'s
    layer: the pixel counts of one image from which its tile changes, ascending, the first 1
    (a call's map, its pixels padded to ``PIXEL_QUANTUM``, runs the kernel of the last class
    at or below that count)."""
    func = _tensor_core_definition(shape.any_size(), target, "NCHW", 1)
    if func is None:
        return (1,)
    return SampleOnceTensorCoreCUDA().pixel_classes(func, target)


def split_parts(shape: ConvShape, target: Target, layout: str = "NCHW") -> int:
    """Into how many parts :func:`forward_schedule` splits ``shape``'s reduction over thread
    blocks (:class:`.cuda.SampleOnceCUDA`) in the kernel of ``shape``'s own size; 1 where it
    does not."""
    if target.kind.name != "cuda":
        return 1
    return SampleOnceCUDA().split_parts(definition.forward(shape, layout), target)


def _tensor_core_definition(
    shape: ConvShape, target: Target, layout: str, min_pixels: int | None = None
) -> tirx.PrimFunc | None:
    """The definition the tensor-core rule is tried on (columns in the layer's half dtype; with
    ``min_pixels``, for any size), or None where it is never tried: not CUDA, or a dtype
    tensor cores do not take."""
    if target.kind.name != "cuda" or shape.dtype not in TENSOR_CORE_MIN_ARCH:
        return None
    if min_pixels is None:
        return definition.forward(shape, layout, column_dtype=shape.dtype)
    return definition.forward(
        shape.any_size(),
        layout,
        column_dtype=shape.dtype,
        sizes="symbolic",
        min_pixels=min_pixels,
        staged_inputs=False,
    )
