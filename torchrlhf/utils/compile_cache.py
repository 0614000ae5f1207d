"""torch.compile's artifacts kept per machine, so that a shape is compiled once per machine, not once per run.

Inductor already caches compiled graphs (FX graph cache) and their AOTAutograd wrappers on disk, keyed by the
graph, the torch version, the compiler and the CPU's instruction set, but under the system's temporary directory,
which containers and reboots empty. `enable_compile_cache` points those caches at one directory per torch version
and machine under ``$TORCHRLHF_COMPILE_CACHE`` (default ``~/.cache/torchrlhf/compile``); an empty value leaves
torch's defaults alone, and so does a ``TORCHINDUCTOR_CACHE_DIR`` the user set.

A second run of a plain ``torch.compile`` then traces with Dynamo and AOTAutograd again (torch 2.13 caches neither
trace) and loads the compiled kernels instead of generating and building them. `compile_ahead` goes further for a
hot function (the engine's decode step): Dynamo's ``aot_compile`` saves the whole compiled function, graph and
guards, under the same directory, and a second process loads it without tracing at all. Each directory holds a stamp
(torch version, CPU model and vector instruction sets, CUDA device): a cache whose stamp is missing or another
machine's is started afresh with one warning, and
directories of other torch versions or machines beside it are never read, only named in one log line. A corrupt
file costs a recompilation, never a crash or a wrong result: a process records the size and hash of every cache
file at exit, and the next one deletes those that changed (inductor would load a truncated generated module as it
is and fail; tested with truncated files).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import platform
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from torchrlhf.models.loading import USER_CACHE, user_cache_path
from torchrlhf.utils.calibration import device_name

ENV = "TORCHRLHF_COMPILE_CACHE"
STAMP = "stamp.json"
VEC_ISA = "vec_isa.json"  # the vector ISAs inductor's build-and-load probe passed on this machine
MANIFEST = "manifest.json"  # relative path -> [size, mtime_ns, sha256] of every file a finished process wrote

log = logging.getLogger(__name__)


def compile_cache_root() -> Path | None:
    """Where compile caches are kept, or None (``TORCHRLHF_COMPILE_CACHE=""``: torch's defaults)."""
    return user_cache_path(ENV, USER_CACHE / "compile")


_ISA_FLAG = re.compile(r"^(avx|amx|fma|f16c|sse|ssse|asimd|sve|bf16|i8mm)")


def cpu_isa(cpuinfo: str) -> str:
    """The vector instruction sets ``/proc/cpuinfo``'s text names: machines of one model name differ here (a virtual
    machine's host may hide AVX-512), and a kernel built for an instruction the CPU lacks kills the process that
    loads it."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return " ".join(sorted(f for f in line.split(":", 1)[1].split() if _ISA_FLAG.match(f)))
    return platform.machine()


def machine_stamp() -> dict[str, str]:
    """What a cache is valid for: this torch build and this machine's compute device."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    stamp = {"torch": torch.__version__, "cpu": device_name(torch.device("cpu")), "cpu_isa": cpu_isa(cpuinfo)}
    if torch.cuda.is_available():
        stamp["cuda"] = f"{torch.version.cuda} {device_name(torch.device('cuda'))}"
    return stamp


def _key(stamp: dict[str, str]) -> str:
    text = json.dumps(stamp, sort_keys=True)
    return f"torch-{stamp['torch'].replace('+', '_')}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _user_set_inductor_dir() -> bool:
    """Whether ``TORCHINDUCTOR_CACHE_DIR`` names a directory of the user's (inductor writes its default there too,
    at its first cache access)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return env is not None and os.path.abspath(env) != os.path.abspath(default_cache_dir())


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """An exclusive lock on the cache root, between processes (released when the file closes)."""
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _files(path: Path):
    for f in sorted(path.rglob("*")):
        if f.is_file() and f.name not in (STAMP, MANIFEST) and not f.name.endswith(".tmp"):
            yield f.relative_to(path).as_posix(), f


def _entry(f: Path) -> list:
    st = f.stat()
    return [st.st_size, st.st_mtime_ns, hashlib.sha256(f.read_bytes()).hexdigest()]


def _changed(f: Path, entry: list) -> bool:
    """Whether ``f`` lost the bytes recorded in ``entry`` (hashed again only when its size is the same and its
    modification time is not: every process start checks the whole cache)."""
    st = f.stat()
    if st.st_size != entry[0]:
        return True
    return st.st_mtime_ns != entry[1] and _entry(f)[2] != entry[2]


def _drop_corrupt(path: Path) -> None:
    """Delete every cache file that no longer has the bytes it had when its process finished (inductor would load
    a truncated generated module as it is and fail), so that it is compiled again."""
    manifest = _read_json(path / MANIFEST)
    if manifest is not None and not all(isinstance(e, list) and len(e) == 3 for e in manifest.values()):
        manifest = None  # not a manifest of ours
    if manifest is None:
        if (path / MANIFEST).exists():
            log.warning("compile cache %s: its manifest is unreadable; starting it afresh", path)
            shutil.rmtree(path / "inductor", ignore_errors=True)
            (path / MANIFEST).unlink()
        return
    corrupt = [rel for rel, f in _files(path) if rel in manifest and _changed(f, manifest[rel])]
    for rel in corrupt:
        (path / rel).unlink()
        del manifest[rel]
    if corrupt:
        log.warning("compile cache %s: %d file(s) changed since they were written (%s); they will be compiled "
                    "again", path, len(corrupt), ", ".join(corrupt[:3]) + (", ..." if len(corrupt) > 3 else ""))
        _write_json(path / MANIFEST, manifest)


def _record(root: Path, path: Path) -> None:
    """At exit: add the files this process (or another) wrote since to the manifest."""
    try:
        with _locked(root):
            manifest = _read_json(path / MANIFEST) or {}
            new = {rel: _entry(f) for rel, f in _files(path) if rel not in manifest}
            if new:
                _write_json(path / MANIFEST, {**manifest, **new})
    except OSError as e:  # a cache that cannot be recorded is only a cache
        log.warning("compile cache %s: could not record its files (%s)", path, e)


@functools.cache
def enable_compile_cache() -> Path | None:
    """Point inductor's (and Triton's) caches at this machine's directory; returns it, or None where torch's
    defaults stay. Call before the first compilation; later calls return the first answer."""
    root = compile_cache_root()
    if root is None or _user_set_inductor_dir():
        return None
    stamp = machine_stamp()
    path = root / _key(stamp)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root):  # ranks started together: one checks the stamp and the files
            if _read_json(path / STAMP) != stamp:
                if path.exists():
                    log.warning("compile cache %s: its stamp is missing, unreadable or not this machine's; "
                                "starting it afresh", path)
                    shutil.rmtree(path)
                path.mkdir()
                _write_json(path / STAMP, stamp)
            _drop_corrupt(path)
    except OSError as e:  # a cache is only a cache: compile as torch does by default
        log.warning("compile cache %s unusable (%s): torch's default cache directory stays", path, e)
        return None
    atexit.register(_record, root, path)
    others = sorted(p.name for p in root.iterdir() if p.is_dir() and p != path)
    if others:
        log.info("compile cache %s: ignoring %d cache(s) made by another torch version or machine: %s",
                 path, len(others), ", ".join(others))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(path / "triton"))
    return path


AHEAD = "ahead"  # compile_ahead's saved functions, one folder per name and call fingerprint
MAX_AHEAD = 8  # saved variants per folder (Dynamo's own recompile limit is 8 too)


def _fingerprint(args: tuple) -> str:
    """What an argument list looks like to the guards that matter most (every tensor's dtype, rank and device, a
    module's parameters' shapes): calls that differ here are compiled into different folders, so a process loads
    only the variants it may use. The saved guards still decide."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"T{a.dtype}{a.dim()}{a.device.type}")
        elif isinstance(a, (list, tuple)):
            parts.append(f"[{_fingerprint(tuple(a))}]")
        elif isinstance(a, torch.nn.Module):
            parts.append(";".join(f"{n}{tuple(p.shape)}{p.dtype}" for n, p in a.named_parameters()))
        elif hasattr(a, "__dict__"):  # an object whose method is compiled: its tensors and modules
            held = tuple(v for v in vars(a).values() if isinstance(v, (torch.Tensor, torch.nn.Module)))
            parts.append(f"{type(a).__qualname__}({_fingerprint(held)})")
        else:
            parts.append(type(a).__name__)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _sources_unchanged(fn: Any) -> bool:
    """Whether every module the saved function traced code of (ours, transformers', torch's) still reads as it did:
    a saved graph of edited code would run the old code, silently. Whole modules, not the traced lines only:
    Dynamo does not save its guards on globals, so a changed module constant is a change too."""
    for source in fn.source_info().inlined_sources:
        try:
            if inspect.getsource(importlib.import_module(source.module)) != source.content:
                return False
        except (ImportError, OSError, TypeError):
            return False
    return True


def _isa_candidates() -> list[str] | None:
    """The vector ISAs inductor would probe on this x86 CPU, by its flags alone; None on other CPUs."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        from torch._inductor.cpu_vec_isa import supported_vec_isa_list, x86_isa_checker
    except ImportError:  # inductor moved them: its probe runs as usual
        return None
    flags = x86_isa_checker()
    return [str(isa) for isa in supported_vec_isa_list if all(f in flags for f in str(isa).split())]


def _record_vec_isa(path: Path) -> None:
    """After a compilation: which vector ISAs inductor's probe passed here (it has run by then, and cached its
    answer in this process)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    if not (path / VEC_ISA).exists():
        _write_json(path / VEC_ISA, {"passed": [str(isa) for isa in valid_vec_isa_list()]})


def _known_vec_isa(path: Path) -> contextlib.AbstractContextManager:
    """Inductor proves every vector ISA the CPU's flags name, in every process, by building a probe and loading it in
    a child Python (0.4-0.8 s of a 2-core machine's warm-up). Where an earlier process on this machine (the stamp
    includes the flags) saw every candidate pass, the load says so instead (``config.cpp.vec_isa_ok``), and the
    answer is the probe's. It covers that probe only: on a CPU with AVX-512's bf16 or VNNI instructions, or AMX,
    inductor's further checks of those still build in every process. Only around a load: that setting is part of
    inductor's cache keys, which a later compilation in the process must compute as the first process did."""
    from torch._inductor import config

    passed = (_read_json(path / VEC_ISA) or {}).get("passed")
    if config.cpp.vec_isa_ok is not None or passed is None or passed != _isa_candidates():
        return contextlib.nullcontext()
    return config.patch({"cpp.vec_isa_ok": True})


def _no_duck_sizing() -> contextlib.AbstractContextManager:
    """Sizes traced as separate symbols even where equal (a decode span equal to the slot count is no special
    case, which would cost another compilation the first time they differ)."""
    return torch.fx.experimental._config.patch(use_duck_shape=False)


class _CompiledAhead:
    """`compile_ahead`'s callable: the saved variants whose guards pass, else a new one compiled and saved."""

    def __init__(self, fn: Callable[..., Any], name: str, dynamic: bool | None):
        self.fn, self.name, self.dynamic = fn, name, dynamic
        self.owner = getattr(fn, "__self__", None)  # a bound method's object: the traced function's first argument
        self.variants: list[Any] = []
        self.loaded = False  # the saved variants are read at the first call, which fingerprints the arguments
        self.cache: Path | None = None  # this machine's compile cache; None without one
        self.folder: Path | None = None  # where this call's variants are saved
        self.fallback: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.fallback is not None:
            with _no_duck_sizing():
                return self.fallback(*args)
        full = args if self.owner is None else (self.owner, *args)
        if not self.loaded:
            self._load(full)
        for variant in self.variants:
            if variant.guard_check(*full):
                return variant.fn(*full)
        if self.variants and torch._dynamo.config.error_on_recompile:
            raise RuntimeError(f"compile_ahead({self.name!r}): no saved variant's guards pass, and "
                               f"torch._dynamo.config.error_on_recompile is set")
        return self._compile(args, full)

    def _load(self, full: tuple) -> None:
        self.loaded = True
        self.cache = enable_compile_cache()
        if self.cache is None:
            return
        self.folder = self.cache / AHEAD / f"{self.name}-{_fingerprint(full)}"
        for path in sorted(self.folder.glob("*.bin")):
            try:
                with open(path, "rb") as f, _known_vec_isa(self.cache):
                    variant = torch.compiler.load_compiled_function(f)
                if _sources_unchanged(variant):
                    self.variants.append(variant)
                else:
                    log.info("compile cache: %s was traced from code that has changed since; compiling again", path)
                    path.unlink()
            except Exception as e:  # a cache is only a cache: a file it cannot load is compiled again
                log.warning("compile cache: could not load %s (%s: %s); compiling again", path, type(e).__name__, e)
                path.unlink(missing_ok=True)

    def _compile(self, args: tuple, full: tuple) -> Any:
        try:
            with _no_duck_sizing(), torch._dynamo.config.patch(specialize_float=True):  # aot_compile cannot
                # restart a trace, which a float made a tensor would ask for
                variant = torch.compile(self.fn, dynamic=self.dynamic, fullgraph=True).aot_compile((args, {}))
        except Exception as e:  # not every graph can be compiled ahead yet (the API is experimental)
            log.warning("compile_ahead(%r): Dynamo's aot_compile failed (%s: %s); using torch.compile, whose trace "
                        "is not saved", self.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.fallback = torch.compile(self.fn, dynamic=self.dynamic)
            with _no_duck_sizing():
                return self.fallback(*args)
        self.variants.append(variant)
        if self.cache is not None and len(list(self.folder.glob("*.bin"))) < MAX_AHEAD:
            try:
                _record_vec_isa(self.cache)
                self.folder.mkdir(parents=True, exist_ok=True)
                variant.save_compiled_function(str(self.folder / f"{len(self.variants) - 1}-{os.getpid()}.bin"))
            except Exception as e:  # unpicklable state (say, a process group): this process keeps it in memory
                log.warning("compile_ahead(%r): could not save the compiled function (%s: %s)", self.name,
                            type(e).__name__, e)
        return variant.fn(*full)


def compile_ahead(fn: Callable[..., Any], name: str, *, dynamic: bool | None = None) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=dynamic)`` whose whole compilation is saved in this machine's compile cache and
    loaded by the next process: Dynamo's trace and guards, AOTAutograd's graph and inductor's code. ``name`` names
    its folder. The graph must need no graph break (it is compiled with ``fullgraph=True``); where Dynamo's
    ``aot_compile`` fails, it is a plain ``torch.compile`` with one warning.

    A saved variant is used only where its guards pass on the call's arguments and every source line it traced is
    unchanged; otherwise another variant is compiled and saved. The files are pickles that name code to import, as
    inductor's cached modules are code it runs: keep the cache directory as private as the code itself."""
    enable_compile_cache()
    return _CompiledAhead(fn, name, dynamic)


__all__ = ["ENV", "compile_ahead", "compile_cache_root", "enable_compile_cache", "machine_stamp"]
