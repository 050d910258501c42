"""How a call reaches its kernels (build and dispatch layer): the tensors of a validated call
laid out as the PrimFuncs take them (flattened pixels, contiguous views, the workspaces of the
backward), the device's target, and the kernels run on the tensors' device (CUDA kernels on
torch's current stream). The binding's ops, the measured dispatch and the benchmarks all call
through here."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Sequence

import torch
import tvm_ffi
from tvm.target import Target

from tvm_deform import env
from tvm_deform.ir import definition
from tvm_deform.ir.definition import ConvShape
from tvm_deform.runtime import kernels, targets

__all__ = ["device_target", "images_per_call", "run_backward", "run_forward", "scratch"]


#: the most bytes of sampled columns (the im2col matrix, a workspace from torch's caching
#: allocator) that one call of a GPU kernel for any size writes: a larger batch runs in chunks
#: of images, each a call of its own (about 77 MB an image for a 128-channel 3x3 layer at
#: 100x167 output pixels, the third stage of a ResNet at 800x1333)
COLUMN_BYTES = 512 * 2**20

#: the most thread blocks along a CUDA grid's ``y`` or ``z`` axis, where the kernels run the
#: images (the backward's column gradient runs (image, tap) pairs along ``z``): a larger batch
#: runs in chunks of images (see :func:`images_per_call`)
GRID_IMAGES = 65535


def run_forward(
    shape: ConvShape,
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    kernel: kernels.Kernel | None = None,
) -> torch.Tensor:
    """Run ``kernel`` (default: the one dispatch picks for ``shape`` on the tensors' device)
    on validated tensors, CPU or CUDA. A CUDA kernel runs on torch's current stream of the
    tensors' device, without synchronising. With the kernels dispatch picks (``kernel``
    None), a GPU batch runs in chunks of images where one call's grid or workspace could not
    take it (see :func:`images_per_call`)."""
    output = input.new_empty((shape.batch, shape.out_channels, shape.out_h, shape.out_w))
    if shape.batch == 0:
        return output
    images, target = shape.batch, None
    if kernel is None:
        target = device_target(input.device)
        images = images_per_call(shape, target)
    if images >= shape.batch:
        _launch(shape, input, offset, weight, bias, mask, output, kernel, target)
        return output
    for start in range(0, shape.batch, images):
        stop = min(start + images, shape.batch)
        _launch(
            dataclasses.replace(shape, batch=stop - start),
            input[start:stop],
            offset[start:stop],
            weight,
            bias,
            mask[start:stop] if mask is not None else None,
            output[start:stop],
            kernel,
            target,
        )
    return output


def images_per_call(
    shape: ConvShape, target: Target, op: str = "forward", tuned: bool | None = None
) -> int:
    """How many images of ``shape``'s batch one call of its ``op``'s kernels on ``target``
    takes: all of them on a CPU; on a GPU at most what the grid takes (:data:`GRID_IMAGES`,
    divided by the taps for the backward), and where such a chunk runs kernels for any size
    (``tuned``, default ``TVM_DEFORM_TUNED``, as for ``kernels.any_size``) and its columns
    would pass :data:`COLUMN_BYTES`, as many as fit, at least one. (The forward's sampled
    columns are a workspace of ``batch x channels x taps x pixels``; the backward's column
    gradient and recomputed columns are two more of that size. A kernel for one size sizes
    its own workspaces.)"""
    if target.kind.name != "cuda":
        return shape.batch
    grid = GRID_IMAGES // shape.taps if op == "backward" else GRID_IMAGES
    images = min(shape.batch, max(1, grid))
    element = 8 if shape.accumulator_dtype == "float64" else 4
    per_image = shape.in_channels * shape.taps * shape.out_h * shape.out_w * element
    if per_image * images <= COLUMN_BYTES:
        return images
    tuned = env.tuned_enabled() if tuned is None else tuned
    chunk = dataclasses.replace(shape, batch=images)
    if not kernels.any_size(chunk, target, tuned, op=op):
        return images
    return max(1, COLUMN_BYTES // per_image)


#: the alignment, in bytes, of the weight a CUDA forward kernel reads: the tensor-core GEMM
#: copies it 16 bytes at a time
CUDA_WEIGHT_ALIGNMENT = 16


def aligned(tensor: torch.Tensor, alignment: int) -> torch.Tensor:
    """``tensor``, or a copy of it where its data does not start at a multiple of
    ``alignment`` bytes (a view into a larger tensor, e.g. ``big[1:]``)."""
    return tensor if tensor.data_ptr() % alignment == 0 else tensor.clone()


def _launch(
    shape: ConvShape,
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    output: torch.Tensor,
    kernel: kernels.Kernel | None,
    target: Target | None,
) -> None:
    """One call of the forward kernel into ``output``: ``kernel``, or the one dispatch picks
    for ``target``."""
    cuda = input.device.type == "cuda"
    # A channels_last input on the CPU is read in place by a kernel that takes NHWC.
    nhwc = kernel is None and not cuda and is_channels_last(input)
    if kernel is None:
        layout = "NHWC" if nhwc else "NCHW"
        kernel = kernels.get_kernel(shape, target, layout=layout)
    if not cuda:
        kernels.configure_threads(torch.get_num_threads())
    pixels = shape.out_h * shape.out_w
    # .contiguous() returns the tensor itself when it already is; the views below are free, so a
    # contiguous tensor reaches the kernel without a copy (TVM reads torch memory via DLPack).
    args = [
        input.permute(0, 2, 3, 1) if nhwc else input.contiguous(),
        offset.contiguous().view(shape.batch, -1, pixels),
    ]
    if mask is not None:
        args.append(mask.contiguous().view(shape.batch, -1, pixels))
    weight = weight.contiguous()
    if cuda:
        weight = aligned(weight, CUDA_WEIGHT_ALIGNMENT)
    args.append(weight.view(shape.out_channels, -1, shape.taps))
    if bias is not None:
        args.append(bias.contiguous())
    args.append(output.view(shape.batch, shape.out_channels, pixels))
    if cuda:
        with torch.cuda.device(input.device), tvm_ffi.use_torch_stream():
            kernel(*args)
    else:
        kernel(*args)


def is_channels_last(input: torch.Tensor) -> bool:
    """A channels_last tensor that is not also NCHW-contiguous (one channel, or 1x1 images)."""
    return input.is_contiguous(memory_format=torch.channels_last) and not input.is_contiguous()


def device_target(device: torch.device) -> Target:
    """The target whose kernels run on ``device``: this machine's CPU, or the CUDA target of
    the GPU (its compute capability, ``sm_90`` on an H100 or H200, and its multiprocessor count
    and L2 cache size)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_device_target(index)
    return targets.host_target()


@functools.cache
def _cuda_device_target(index: int) -> Target:
    properties = torch.cuda.get_device_properties(index)
    return targets.cuda_target(
        f"sm_{properties.major}{properties.minor}",
        multiprocessors=properties.multi_processor_count,
        l2_cache_bytes=getattr(properties, "L2_cache_size", None),
    )


_TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def run_backward(
    shape: ConvShape,
    grad_output: torch.Tensor,
    input: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    mask: torch.Tensor | None,
    compiled: kernels.BackwardKernels | None = None,
    output_mask: tuple[bool, bool, bool, bool, bool] = (True,) * 5,
) -> tuple[
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
]:
    """The gradients ``(input, offset, mask, weight, bias)`` of ``shape``'s forward for
    ``grad_output``, each computed only when ``output_mask`` asks for it (as in
    ``aten::convolution_backward``) and None otherwise; the mask's is None without a mask, the
    bias's None when ``shape`` has no bias. ``compiled`` (the backward kernels) defaults to the
    ones dispatch picks for ``shape``, the tensors' device and the gradients asked for. CUDA
    kernels run on torch's current stream of the tensors' device. With the kernels dispatch
    picks, a GPU batch runs in chunks of images as the forward's does (see
    :func:`images_per_call`), the weight's and bias's gradients of the chunks added in
    order."""
    want_input, want_offset, want_mask, want_weight, want_bias = output_mask
    want_mask = want_mask and mask is not None
    want_bias = want_bias and shape.has_bias
    gradients = definition.Gradients(
        input=want_input, sampling=want_offset or want_mask, weight=want_weight or want_bias
    )
    # The kernels write every element of what they compute; an empty batch leaves zeros.
    empty = shape.batch == 0
    like = torch.zeros_like if empty else torch.empty_like
    contiguous = torch.contiguous_format
    grad_input = like(input, memory_format=contiguous) if gradients.input else None
    grad_offset = grad_mask = grad_weight = grad_bias = None
    if gradients.sampling:
        grad_offset = like(offset, memory_format=contiguous)
        grad_mask = like(mask, memory_format=contiguous) if mask is not None else None
    if gradients.weight:
        grad_weight = like(weight, memory_format=contiguous)
        if shape.has_bias:
            grad_bias = (weight.new_zeros if empty else weight.new_empty)(shape.out_channels)
    if not empty and gradients != definition.Gradients(False, False, False):
        images, target = shape.batch, None
        if compiled is None:
            target = device_target(input.device)
            # Dispatch reads the tuning logs only for the kernels of every gradient (None:
            # as TVM_DEFORM_TUNED says, read only where a GPU's columns could be too large).
            tuned = None if gradients == definition.ALL_GRADIENTS else False
            images = images_per_call(shape, target, "backward", tuned)
            if images >= shape.batch:
                compiled = kernels.get_backward(shape, target, gradients=gradients)
        run = functools.partial(
            _run_backward_kernels
            if images >= shape.batch
            else functools.partial(_run_backward_in_chunks, images, target),
            shape,
            compiled,
            grad_output,
            input,
            offset,
            weight,
            mask,
            gradients,
            (grad_input, grad_offset, grad_mask, grad_weight, grad_bias),
        )
        if input.device.type == "cuda":
            with torch.cuda.device(input.device), tvm_ffi.use_torch_stream():
                run()
        else:
            kernels.configure_threads(torch.get_num_threads())
            run()
    return (
        grad_input,
        grad_offset if want_offset else None,
        grad_mask if want_mask else None,
        grad_weight if want_weight else None,
        grad_bias if want_bias else None,
    )


#: the most bytes of CPU workspaces (the backward's column gradient and sampling geometry) a
#: thread keeps for its next call: fresh pages of a large allocation are faulted in and zeroed
#: by the kernel at every call (about 9 ms of a 38 MB column gradient on a 2-core Zen 4)
SCRATCH_BYTES = 256 * 2**20

#: the bytes each workspace starts on a multiple of
_SCRATCH_ALIGN = 64

_scratch = threading.local()


def scratch(
    device: torch.device, specs: Sequence[tuple[Sequence[int], torch.dtype]]
) -> list[torch.Tensor]:
    """Uninitialised tensors of the given (shape, dtype) on ``device`` for a kernel call's
    workspaces, valid until the calling thread's next call. On a CPU they are carved from one
    buffer per thread, kept for the next call up to :data:`SCRATCH_BYTES`; on a GPU they
    come from torch's caching allocator, which already reuses its memory."""
    if device.type != "cpu":
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    sizes = [
        -(-math.prod(shape) * dtype.itemsize // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
        for shape, dtype in specs
    ]
    total = sum(sizes)
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < total:
        buffer = torch.empty(total, dtype=torch.uint8)
        _scratch.buffer = buffer if total <= SCRATCH_BYTES else None
    tensors, start = [], 0
    for (shape, dtype), size in zip(specs, sizes, strict=True):
        count = math.prod(shape)
        piece = buffer[start : start + count * dtype.itemsize]
        tensors.append(piece.view(dtype).view(tuple(shape)))
        start += size
    return tensors


def _run_backward_in_chunks(
    images, target, shape, compiled, grad_output, input, offset, weight, mask, gradients, grads
) -> None:
    """:func:`_run_backward_kernels`, run on chunks of ``images`` images with ``compiled``
    (None: the kernels dispatch picks for each chunk on ``target``, one size's own where
    they are not for any size): each chunk's input, offset and mask gradients go to its slice
    of the batch's; its weight and bias gradients to buffers of their own, added in the
    chunks' order in the accumulator's dtype (the same bits on every run)."""
    grad_input, grad_offset, grad_mask, grad_weight, grad_bias = grads
    acc = _TORCH_DTYPES[shape.accumulator_dtype]
    sums: list[torch.Tensor | None] = [None, None]
    for start in range(0, shape.batch, images):
        part = slice(start, min(start + images, shape.batch))
        totals = [None if g is None else torch.empty_like(g) for g in (grad_weight, grad_bias)]
        chunk = dataclasses.replace(shape, batch=part.stop - part.start)
        _run_backward_kernels(
            chunk,
            compiled
            if compiled is not None
            else kernels.get_backward(chunk, target, gradients=gradients),
            grad_output[part],
            input[part],
            offset[part],
            weight,
            None if mask is None else mask[part],
            gradients,
            (*(None if g is None else g[part] for g in (grad_input, grad_offset, grad_mask)),
             *totals),
        )  # fmt: skip
        for i, total in enumerate(totals):
            if total is not None:
                sums[i] = total.to(acc) if sums[i] is None else sums[i].add_(total)
    for result, total in zip((grad_weight, grad_bias), sums, strict=True):
        if result is not None:
            result.copy_(total)


def _run_backward_kernels(
    shape, compiled, grad_output, input, offset, weight, mask, gradients, grads
) -> None:
    """Run the backward kernels into ``grads`` (input, offset, mask, weight, bias), with the
    arguments :func:`definition.backward` and :func:`definition.grad_input` take."""
    grad_input, grad_offset, grad_mask, grad_weight, grad_bias = grads
    pixels = shape.out_h * shape.out_w
    shapes = definition.backward_buffer_shapes(
        shape, gradients, compiled.quantum, compiled.any_size
    )
    grad_output = grad_output.contiguous().view(shape.batch, shape.out_channels, pixels)
    padded = shapes["grad_output"][-1]
    if padded != pixels:
        # Zero gradient on the padding pixels: they add nothing to the reductions. (Kernels
        # for any size pad it themselves.)
        grad_output = torch.nn.functional.pad(grad_output, (0, padded - pixels))
    acc = _TORCH_DTYPES[shape.accumulator_dtype]
    specs = [
        (shapes["sample_rows"], torch.int32),
        (shapes["sample_cols"], torch.int32),
        (shapes["sample_coef"], acc),
    ]
    if gradients.needs_grad_columns:
        columns = shapes["grad_columns"]
        if compiled.channels_last_columns:
            n, c, k, p = columns
            columns = (n, p, k * c)
        specs.insert(0, (columns, acc))
    workspaces = scratch(input.device, specs)
    args = [input.contiguous(), offset.contiguous().view(shape.batch, -1, pixels)]
    if mask is not None:
        args.append(mask.contiguous().view(shape.batch, -1, pixels))
    args += [weight.contiguous().view(shape.out_channels, -1, shape.taps), grad_output]
    args += workspaces
    if grad_offset is not None:
        args.append(grad_offset.view(shape.batch, -1, pixels))
    if grad_mask is not None:
        args.append(grad_mask.view(shape.batch, -1, pixels))
    if grad_weight is not None:
        args.append(grad_weight.view(shape.out_channels, -1, shape.taps))
    if grad_bias is not None:
        args.append(grad_bias)
    compiled.gradients(*args)
    if grad_input is not None:
        compiled.grad_input(*workspaces, grad_input)
