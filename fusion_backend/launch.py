"""The CUDA implementation of `fusedepi::chain`: kernels found or built per spec and
device, every operand checked, the anchor run, the kernels launched.

`Launcher` runs one spec on one device in Python until the C++ launcher is loaded
(`enable_native`); from then on C++ serves the calls that a `Launcher` has planned
(`native.register`), and the rest come here through `fusedepi::chain_py`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
from pathlib import Path

import torch

import cuda_templates
from lowering import EpilogueSpec
from lowering.spec import operand_numel, operand_size_words

from . import native
from .ops import _LIB, _parse, anchor_inputs, arch_of, conv_allows_tf32, matmul_allows_tf32, reference, run_anchor

log = logging.getLogger("fusedepi")

_kernels: dict[tuple, cuda_templates.Library] = {}
_launchers: dict[tuple, "Launcher"] = {}
_kernels_lock = threading.Lock()


def kernel_for(spec: str, device: torch.device, cache_dir: Path, conv_tf32: bool = False,
               line_info: bool = False) -> cuda_templates.Library:
    """Renders, compiles (or finds in the cache) and loads the kernel for `spec`
    (conv_tf32: the variant for float32 convolutions that may use TF32; line_info: built
    with -lineinfo, FUSEDEPI_DEBUG).

    Raises:
        cuda_templates.NotRenderable: no template covers the spec.
        cuda_templates.CompileError: nvcc failed or is missing.
    """
    arch = arch_of(device)
    key = (spec, arch, str(cache_dir), conv_tf32, line_info)
    lib = _kernels.get(key)
    if lib is None:
        parsed = _parse(spec)
        source = cuda_templates.render(parsed, arch, conv_tf32=conv_tf32)
        name = cuda_templates.kernel_name(parsed, arch, conv_tf32)
        lib = cuda_templates.load(source, name, cuda_templates.build_arch(parsed, arch, conv_tf32), cache_dir,
                                   line_info)
        with _kernels_lock:
            _kernels[key] = lib
    return lib


def first_line(err: BaseException) -> str:
    """A failure's first line for a warning or a report (a build error's nvcc output
    follows it), or its type where it has no message."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 32-byte aligned: kernels read operands as whole vectors."""
    if t.is_contiguous() and t.data_ptr() % 32 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class Launcher:
    """Runs one spec on one device; everything that does not change per call is fixed here."""

    def __init__(self, spec: str, device: torch.device, conv_tf32: bool = False):
        from .config import load_config

        self.spec = _parse(spec)
        self.spec_json = spec
        self.conv_tf32 = conv_tf32  # the variant built for cuDNN's TF32 flag on (reads_conv_tf32)
        self.device_index = device.index
        cfg = load_config()
        self.lib = kernel_for(spec, device, cfg.cache_dir, conv_tf32, cfg.debug)
        self.n_operands = self.spec.anchor.n_operands
        self.row_output = self.spec.row_output
        # A reduced output's dims after the rows: (), (1,), (C,) or (C, 1, ...); then, for a
        # reduction over a conv's channels, the conv output's spatial dims.
        self.reduced_tail = self.spec.reduced_tail() if self.row_output else ()
        self.keeps_spatial = self.spec.keeps_spatial
        bn = next((s for s in self.spec.steps if s.name == "batchnorm_train"), None)
        self.running_stats = (bn.inputs[2], bn.inputs[3]) if bn is not None else ()
        self._ws_floats: dict[int, int] = {}
        self.saves = [(save, getattr(torch, save.dtype)) for save in self.spec.saves]
        # The library computes the anchor: the in-kernel GEMM, or the direct conv, whose
        # float32 variants (FMA or TF32) with GroupNorm store the pre-norm value in a buffer.
        self.gemm = self.lib.anchor_inside and isinstance(
            cuda_templates.gemm_plan(self.spec, arch_of(device)), cuda_templates.GemmPlan)
        # FUSEDEPI_IN_KERNEL_GEMM=auto: per call, the in-kernel GEMM where the rows fill
        # the GPU with its tiles, else the library GEMM and the file's epilogue kernel.
        self.gemm_sms = torch.cuda.get_device_properties(device).multi_processor_count if self.gemm else 0
        self.gemm_auto = self.gemm and not self.spec.anchor.gemm[1]
        # A float32 product runs in TF32 in the kernel: only while the matmul precision
        # allows TF32 (read at every call, as eager's cuBLAS call reads it); else cuBLAS.
        self.gemm_tf32 = self.gemm and self.spec.dtype == "float32"
        self._gemm_rows: dict[int, bool] = {}
        # Who computes the anchor: the in-kernel GEMM (or, per call, the library GEMM and the
        # file's epilogue kernel), the file's direct conv, or the library before the kernels.
        # The C++ launcher takes the same paths (native.PATH_CODES).
        implicit = cuda_templates.conv_gemm_plan(self.spec, arch_of(device), conv_tf32)
        if self.gemm:
            self.anchor_path = "in-kernel GEMM"
        elif self.lib.anchor_inside and isinstance(implicit, cuda_templates.ConvGemmPlan):
            self.anchor_path = "in-kernel conv"
        elif self.lib.anchor_inside:
            self.anchor_path = "direct conv"
        else:
            self.anchor_path = "library anchor"
        # The in-kernel conv reads x in the graph's NCHW layout, not a channels-last copy.
        self.in_kernel_nchw = self.anchor_path == "in-kernel conv" and implicit.nchw
        direct = cuda_templates.direct_plan(self.spec, arch_of(device), conv_tf32)
        self.stores_pre_norm = (
            self.anchor_path == "direct conv" and direct.stores_pre_norm and self.spec.reduction is not None
        )
        self.reads_conv_tf32 = reads_conv_tf32(spec)
        self.anchor_sizes = anchor_operand_sizes(self.spec, self.anchor_path)
        # Whether the C++ launcher has this launcher's plan (launcher_for registers it).
        self.native = False

    def in_kernel_gemm(self, rows: int) -> bool:
        """Whether a call with `rows` rows computes the GEMM in the chain's kernel."""
        if not self.gemm or (self.gemm_tf32 and not matmul_allows_tf32()):
            return False
        if not self.gemm_auto:
            return True
        use = self._gemm_rows.get(rows)
        if use is None:
            use = self._gemm_rows[rows] = cuda_templates.fills_gpu(rows, self.spec.channels, self.gemm_sms)
        if self.native:  # the C++ launcher asked Python because it did not know these rows
            native.register_rows(self.spec_json, self.device_index, rows, use)
        return use

    def _pad_x(self, x: torch.Tensor, xp: torch.Tensor) -> None:
        """padded_gemm's x into its padded rows, by the kernel file's pad kernel."""
        self.lib.pad_rows(x.data_ptr(), xp.data_ptr(), x.shape[0], x.shape[1], self.device_index,
                          torch._C._cuda_getCurrentRawStream(self.device_index))

    def _row_shape(self, rows: int, spatial: tuple = ()) -> tuple:
        """A reducing chain's output: a value a row ([rows], [rows, 1] with keepdim), a
        value per row and channel ([rows, C], [rows, C, 1, ...] with keepdim), or a value
        per row and pixel ([rows, *spatial], [rows, 1, *spatial] with keepdim)."""
        return (rows,) + self.reduced_tail + (tuple(spatial) if self.keeps_spatial else ())

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        check_devices(inputs, self.device_index, self.spec.fusion)
        # x and the weight rounded to TF32 where the in-kernel conv runs, else themselves
        inputs = anchor_inputs(inputs, self.spec, rounded_now=self.anchor_path == "in-kernel conv")
        anchor_operands = list(inputs[: self.n_operands])
        check_anchor_operands(anchor_operands, self.spec, self.anchor_path, self.anchor_sizes)
        params = [_aligned(p) for p in inputs[self.n_operands :]]
        in_kernel = self.gemm and self.in_kernel_gemm(anchor_operands[-2].shape[0])  # x's rows
        library_gemm = self.gemm and not in_kernel
        if in_kernel:
            # In-kernel GEMM: x, and the weight w[N, K] that mat2 = w^T transposes, as the
            # bulk copies read them (contiguous rows, 16-byte aligned).
            anchor_operands = [_aligned(t) for t in anchor_operands[:-1] + [anchor_operands[-1].t()]]
            x = anchor_operands[-2]
            if self.row_output:  # the kernel writes the rows' values, no [rows, N] tensor
                out = y = x.new_empty(self._row_shape(x.shape[0]))
            else:
                out = y = x.new_empty((x.shape[0], self.spec.channels))
        elif self.anchor_path == "direct conv":
            # Direct conv: the library computes the anchor from x and the weight.
            anchor_operands = [_aligned(t) for t in anchor_operands]
            x = anchor_operands[0]
            out = x.new_empty((x.shape[0], self.spec.channels, *self.spec.anchor.direct_out_spatial()))
            y = torch.empty_like(out) if self.stores_pre_norm else out
        elif self.anchor_path == "in-kernel conv":
            # The implicit GEMM reads x channels-last ([rows, H, W, C_in] in memory; or NCHW,
            # `in_kernel_nchw`) and the weight as [C_out, kh, kw, C_in'], both by TMA
            # (`channels_last_operands`).
            anchor_operands = channels_last_operands(anchor_operands, self.spec, self.in_kernel_nchw)
            x = anchor_operands[0]
            if self.row_output:  # a reduction or a pool in the tiles (ConvGemmPlan.reduce, .pixel_reduce, .pool)
                out = y = x.new_empty(self._row_shape(x.shape[0], self.spec.anchor.direct_out_spatial()))
            else:
                out = y = x.new_empty((x.shape[0], self.spec.channels, *self.spec.anchor.direct_out_spatial()))
        else:
            # A padded GEMM's y keeps its padded rows: the kernels read them with that stride.
            # A channels-last conv's y stays channels-last: the kernel writes the output
            # contiguous, as the graph has it.
            y = run_anchor(self.spec.anchor, anchor_operands, for_kernels=True, pad_x=self._pad_x)
            if not self.spec.anchor.channels_last:
                y = y.contiguous()
            if self.row_output:
                out = y.new_empty(self._row_shape(y.shape[0], y.shape[2:]))
            elif self.spec.anchor.pad:
                out = y.new_empty((y.shape[0], self.spec.channels))
            else:
                out = torch.empty_like(y, memory_format=torch.contiguous_format)
        rows = y.shape[0]
        if not self.lib.anchor_inside or library_gemm:  # the library's output: what the kernels will read
            check_anchor_output(y, rows, self.spec)
        check_params(params, rows, self.spec)
        extras = [torch.empty_like(params[i]) for i in self.running_stats]
        # The anchor output itself (saved after 0 steps) is the library's output, y
        # (converted when the graph saved it widened to float32).
        extras += [
            y.view(save.sized(rows)).to(dtype) if save.what == "value" and save.at == 0
            else y.new_empty(save.sized(rows), dtype=dtype)
            for save, dtype in self.saves
        ]
        ws_floats = self._ws_floats.get(rows)
        if ws_floats is None:
            ws_floats = self._ws_floats[rows] = self.lib.workspace_floats(rows)
        # Pointwise chains need no workspace: a null pointer, and no allocation per call.
        # Nor does an in-kernel GEMM file's epilogue kernel (library_gemm): the workspace
        # its library asks for holds the in-kernel GEMM's row partials.
        ws = y.new_empty(ws_floats, dtype=torch.float32) if ws_floats > 0 and not library_gemm else None
        pointers = [y.data_ptr(), out.data_ptr()]
        pointers += [t.data_ptr() for t in extras]
        pointers += [t.data_ptr() for t in params]
        pointers.append(ws.data_ptr() if ws is not None else 0)
        if library_gemm:  # null operands: the kernel file runs its epilogue kernel on y
            pointers += [0] * len(anchor_operands)
        elif self.anchor_path != "library anchor":
            pointers += [t.data_ptr() for t in anchor_operands]
        self.lib.run(pointers, rows, self.device_index, torch._C._cuda_getCurrentRawStream(self.device_index))
        return [out] + extras


# Every call's operands are checked before a kernel reads them: a kernel that reads past
# a tensor, or a CPU pointer, fails with an illegal address, after which the process's
# CUDA context is lost. The C++ launcher tests the same (csrc/launcher.cpp, `inputs_fit`) and
# hands a call that fails to the Python launcher, whose checks raise.


def conv_operand_shapes(spec: EpilogueSpec) -> tuple[tuple, tuple]:
    """x's shape after its rows and the weight's shape that a file's own conv kernels
    are built for: (C_in, H, W) and [C_out, C_in, kh, kw], a 3-D conv's (C_in, D, H, W)
    and [C_out, C_in, kd, kh, kw] (`Anchor.depth`)."""
    cin, kh, kw, h, w = spec.anchor.direct
    kd, d = spec.anchor.depth[:1], spec.anchor.depth[1:]  # (kd,), (D,) or (), ()
    return (cin, *d, h, w), (spec.channels, cin, *kd, kh, kw)


def channels_last_operands(operands: list[torch.Tensor], spec: EpilogueSpec, nchw: bool = False) -> list[torch.Tensor]:
    """The in-kernel conv's x and weight in the memory order its tensor maps read: x
    [rows, C_in, H, W] channels-last (`nchw`: contiguous, the file reads it so; a 3-D
    conv's [rows, C_in, D, H, W] channels-last too), its pixels `conv_sm90.x_pitch`
    elements apart (C_in to whole 16 bytes: a copy whose channels past C_in are left
    unwritten, the kernel never reads them), the weight [C_out, C_in, kh, kw] as
    [C_out, kh, kw, C_in'] contiguous (a 3-D conv's as [C_out, kd, kh, kw, C_in']; C_in'
    = C_in padded with zeros to whole k-steps), each 16-byte aligned.

    Raises:
        RuntimeError: x or the weight is not of the shape the kernel was built for.
    """
    x_row, w_shape = conv_operand_shapes(spec)
    cin = x_row[0]
    x, wt = operands[0], operands[1]
    if x.dim() != len(x_row) + 1 or tuple(x.shape[1:]) != x_row or tuple(wt.shape) != w_shape:
        raise RuntimeError(f"fusedepi::chain ({spec.fusion}): conv operands {tuple(x.shape)} and {tuple(wt.shape)}; "
                           f"the kernel was built for [rows, {', '.join(map(str, x_row))}] and {list(w_shape)}")
    layout = torch.contiguous_format if nchw else torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    pitch = cin if nchw else cuda_templates.conv_sm90.x_pitch(cin, x.element_size())
    if pitch != cin:
        x = padded_pixels(x, pitch)
    else:
        x = x.contiguous(memory_format=layout)
        if x.data_ptr() % 16:
            x = x.clone(memory_format=layout)
    # The weight's input channels padded with zeros to whole k-steps: its boxes never
    # reach past a row's end.
    cin_pad = cuda_templates.conv_sm90.padded_in_channels(cin, spec.dtype)
    channels_last = (0, *range(2, wt.dim()), 1)
    if cin_pad == cin:
        w = wt.permute(channels_last).contiguous()  # wt itself where it is channels-last already
        return [x, w.clone() if w.data_ptr() % 16 else w]
    padded = wt.new_zeros((spec.channels, *w_shape[2:], cin_pad))
    padded[..., :cin] = wt.permute(channels_last)
    return [x, padded]


def padded_pixels(x: torch.Tensor, pitch: int) -> torch.Tensor:
    """x [rows, C, *spatial] channels-last with its pixels `pitch` elements apart (a
    view of a fresh [rows, *spatial, pitch] buffer, 16-byte aligned), x's values copied
    in; the channels from C to `pitch` are not written. x itself where it is so already."""
    c = x.shape[1]
    order = (0, *range(2, x.dim()), 1)  # the buffer's dims: rows, spatial, channels
    strides = [0] * x.dim()
    step = pitch
    for d in reversed(order[:-1]):
        strides[d] = step
        step *= x.shape[d]
    strides[1] = 1
    if tuple(x.stride()) == tuple(strides) and x.data_ptr() % 16 == 0:
        return x
    buffer = x.new_empty((*(x.shape[d] for d in order[:-1]), pitch))
    padded = buffer[..., :c].permute(0, x.dim() - 1, *range(1, x.dim() - 1))
    padded.copy_(x)
    return padded


def check_devices(inputs: list[torch.Tensor], device_index: int, fusion: str) -> None:
    """Every input on the CUDA device the chain runs on.

    Raises:
        RuntimeError: an input elsewhere (on the CPU, or another GPU).
    """
    for i, t in enumerate(inputs):
        if t.device.type != "cuda" or t.device.index != device_index:
            raise RuntimeError(f"fusedepi::chain ({fusion}): input {i} is on {t.device}, the chain on "
                               f"cuda:{device_index}")


def check_anchor_output(y: torch.Tensor, rows: int, spec: EpilogueSpec) -> None:
    """The library's anchor output holds `rows` rows of `spec.y_row` elements."""
    if y.numel() != rows * spec.y_row or y.dtype != getattr(torch, spec.dtype):
        raise RuntimeError(f"fusedepi::chain ({spec.fusion}): the anchor gave {tuple(y.shape)} {y.dtype}; the "
                           f"kernels read rows of {spec.y_row} {spec.dtype} elements")


def anchor_operand_sizes(spec: EpilogueSpec, path: str) -> list[tuple[int, int]]:
    """(elements a row, elements whole) of each anchor operand that a kernel reads itself
    (`path` "direct conv" or "in-kernel conv": x, w[, b]; "in-kernel GEMM": [bias,] x, w[N, K]); else none."""
    if path in ("direct conv", "in-kernel conv"):
        x_row, w_shape = (math.prod(s) for s in conv_operand_shapes(spec))
        return [(x_row, 0), (0, w_shape), (0, spec.channels)][: spec.anchor.n_operands]
    if path == "in-kernel GEMM":
        k = spec.anchor.gemm[0]
        return [(0, spec.channels)] * (spec.anchor.n_operands - 2) + [(k, 0), (0, spec.channels * k)]
    return []


def check_anchor_operands(operands: list[torch.Tensor], spec: EpilogueSpec, path: str, sizes=None) -> None:
    """The anchor's operands, before it runs: the chain's dtype (a padded GEMM's pad kernel
    reads x too); where a kernel computes the anchor, the sizes it was built for (x: K,
    or C_in x H x W, per row; the weight and bias whole). Library calls check the rest."""
    sizes = anchor_operand_sizes(spec, path) if sizes is None else sizes  # (a launcher's, computed once)
    rows = next((t.shape[0] for t, (a_row, _) in zip(operands, sizes) if a_row), 0)  # x's
    for i, t in enumerate(operands):
        a_row, whole = sizes[i] if sizes else (0, t.numel())
        if t.dtype != getattr(torch, spec.dtype) or t.numel() != (a_row * rows or whole):
            raise RuntimeError(f"fusedepi::chain ({spec.fusion}): anchor operand {i} is {tuple(t.shape)} "
                               f"{t.dtype}; the kernel was built for {a_row or whole} {spec.dtype} elements"
                               f"{' a row' if a_row else ''}")


def check_params(params: list[torch.Tensor], rows: int, spec: EpilogueSpec) -> None:
    """The chain's tensor operands: their dtypes and sizes (`EpilogueSpec.param_sizes`)."""
    if len(params) != len(spec.param_dtypes):
        raise RuntimeError(f"fusedepi::chain ({spec.fusion}): {len(params)} operands after the anchor's, "
                           f"the spec has {len(spec.param_dtypes)}")
    for i, (t, dtype, sizes) in enumerate(zip(params, spec.param_dtypes, spec.param_sizes())):
        if t.dtype != getattr(torch, dtype) or t.numel() != operand_numel(sizes, rows):
            raise RuntimeError(f"fusedepi::chain ({spec.fusion}): operand {i} is {tuple(t.shape)} {t.dtype}; the "
                               f"kernel was built for {operand_size_words(sizes, rows, dtype)}")


def forget_loaded() -> None:
    """Drops this process's loaded kernels (and failed builds); the next call finds them
    in the disk cache or builds them again."""
    with _kernels_lock:
        _kernels.clear()
        _launchers.clear()
        _unbuilt.clear()
        if _native_state == "loaded":
            native.forget()


def reads_conv_tf32(spec: str) -> bool:
    """Whether the kernel of `spec` depends on conv_allows_tf32(): a float32 conv that
    the direct conv (stride 1, dilation 1) or the in-kernel conv (`Anchor.implicit`) may
    compute; a strided library conv's file is the same either way."""
    parsed = _parse(spec)
    anchor = parsed.anchor
    return (parsed.dtype == "float32" and anchor.kind == "conv" and bool(anchor.direct)
            and (anchor.unit_stride or anchor.implicit))


def launcher_for(spec: str, device: torch.device) -> Launcher:
    """The launcher of `spec` on `device`; for a float32 conv, of the variant that the
    TF32 setting asks for now (eager's cuDNN reads it at every call too)."""
    tf32 = reads_conv_tf32(spec) and conv_allows_tf32()
    key = (spec, device.index, tf32)
    launcher = _launchers.get(key)
    if launcher is None:
        launcher = Launcher(spec, device, tf32)
        if _native_state == "loaded":
            _register_native(launcher)
        with _kernels_lock:
            _launchers[key] = launcher
    return launcher


# (spec, device index) whose kernel could not be built when first called: the reference runs.
_unbuilt: set[tuple] = set()


def _chain_cuda(inputs, spec):
    device = inputs[0].device
    if (spec, device.index) not in _unbuilt:
        try:
            return launcher_for(spec, device)(inputs)
        except (cuda_templates.NotRenderable, cuda_templates.CompileError) as err:
            # The backend builds every kernel while compiling, and falls back to Inductor
            # there; a build can still happen here, on a device of another architecture
            # than the one compiled for, or after the loaded kernels were dropped.
            from .config import load_config

            if load_config().strict:
                raise
            first = first_line(err)
            log.warning("fusedepi: could not build the kernel of %s on cuda:%s (%s); this chain runs "
                        "its plain-torch reference from now on. Set FUSEDEPI_STRICT=1 to raise instead.",
                        _parse(spec).fusion, device.index, first)
            _unbuilt.add((spec, device.index))
    return reference(inputs, spec)


_LIB.impl("chain_py", _chain_cuda, "CUDA")
# `chain`'s CUDA implementation until the C++ launcher replaces it, in its own library
# object so that it can be taken back alone.
_python_cuda = torch.library.Library("fusedepi", "IMPL")
_python_cuda.impl("chain", _chain_cuda, "CUDA")

# "python" (not tried), "loaded" (C++ serves `chain` on CUDA) or "failed".
_native_state = "python"
_native_lock = threading.Lock()


def native_launcher() -> str:
    """Which implementation serves `fusedepi::chain` on CUDA: "python", "loaded" (the C++
    launcher) or "failed" (its build failed in this process; Python serves)."""
    return _native_state


# `start_native`'s builds by cache directory, each taken by the `enable_native` that
# waits for it.
_native_builds: dict[Path, concurrent.futures.Future] = {}
_NATIVE_BUILD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusedepi-native")


def start_native(cache_dir: Path) -> None:
    """Starts finding or building the C++ launcher (`native.build`) in a thread of its
    own, so that a first build (seconds of a C++ compiler) overlaps the compile's kernel
    builds and timings; `enable_native` with the same `cache_dir` waits for it. Nothing
    happens where the launcher was tried already or its build is under way."""
    with _native_lock:
        if _native_state != "python" or Path(cache_dir) in _native_builds:
            return
        _native_builds[Path(cache_dir)] = _NATIVE_BUILD.submit(native.build, cache_dir)


def enable_native(cache_dir: Path) -> bool:
    """Makes the C++ launcher serve `fusedepi::chain` on CUDA, building it first if the
    cache lacks it (or waiting for the build `start_native` started). Tried once per
    process: after a failure Python serves for good.

    Returns:
        Whether this call loaded it (False: already loaded, or failed before).

    Raises:
        native.BuildError: the build or the load failed (Python serves on).
    """
    global _native_state, _python_cuda
    with _native_lock:
        if _native_state != "python":
            return False
        started = _native_builds.pop(Path(cache_dir), None)
        try:
            native.load(started.result() if started is not None else native.build(cache_dir))
        except native.BuildError:
            _native_state = "failed"
            raise
        # Two CUDA kernels for one op would override each other with a warning: the
        # Python one goes, the C++ one comes, back to back; and Python's comes back if
        # that fails, whatever the failure.
        _python_cuda._destroy()
        try:
            native.install()
        except BaseException as err:
            _python_cuda = torch.library.Library("fusedepi", "IMPL")
            _python_cuda.impl("chain", _chain_cuda, "CUDA")
            _native_state = "failed"
            if isinstance(err, Exception):
                raise native.BuildError(f"cannot install the C++ launcher: {err}") from err
            raise
        _native_state = "loaded"
        for launcher in list(_launchers.values()):  # those made before: their plans too
            _register_native(launcher)
        return True


def _register_native(launcher: Launcher) -> None:
    """Hands the C++ launcher `launcher`'s plan (and the rows it has decided), if it covers it."""
    if not native.covers(launcher):
        return
    try:
        native.register(launcher, launcher.spec_json, launcher.device_index)
    except Exception as err:  # a plan that does not encode is our bug; Python runs the chain all the same
        log.warning("fusedepi: the C++ launcher has no plan for %s (%s: %s); it launches from Python",
                    launcher.spec.fusion, type(err).__name__, err)
        return
    launcher.native = True  # from here on, rows decided in Python are passed on as well
    for rows, use in list(launcher._gemm_rows.items()):
        native.register_rows(launcher.spec_json, launcher.device_index, rows, use)
