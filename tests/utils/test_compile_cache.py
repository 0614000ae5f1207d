"""The per-machine compile cache: where it lives, what it ignores, and that a second process loads (and survives)
what the first one wrote."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Compiles a tiny function in a fresh process (the cache is per process until then) and prints its result and
# inductor's cache counters as JSON.
CHILD = textwrap.dedent("""
    import json, logging, torch
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from torchrlhf.utils.compile_cache import enable_compile_cache
    from torch._dynamo.utils import counters
    path = enable_compile_cache()
    f = torch.compile(lambda x: (x.sin() * 3 + x.cos()).relu().sum(-1))
    x = torch.linspace(-2, 2, 24).view(4, 6)
    out = f(x)
    print(json.dumps({"path": str(path), "out": out.tolist(), "hits": counters["aot_autograd"]["autograd_cache_hit"]
                      + counters["inductor"]["fxgraph_cache_hit"]}))
""")


def run_child(env_updates: dict[str, str]) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(env_updates, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def reference() -> list[float]:
    import torch

    x = torch.linspace(-2, 2, 24).view(4, 6)
    return (x.sin() * 3 + x.cos()).relu().sum(-1).tolist()


def test_second_process_loads_what_the_first_compiled_and_survives_a_corrupt_cache(tmp_path):
    root = tmp_path / "compile"
    (root / "torch-1.0-0123456789ab").mkdir(parents=True)  # another torch version's cache: left alone, named once
    first, log = run_child({"TORCHRLHF_COMPILE_CACHE": str(root)})
    path = Path(first["path"])
    assert path.parent == root and (path / "stamp.json").is_file() and (path / "inductor").is_dir()
    assert first["hits"] == 0 and first["out"] == pytest.approx(reference(), abs=1e-5)
    assert log.count("ignoring 1 cache(s) made by another torch version or machine: torch-1.0-0123456789ab") == 1
    assert (root / "torch-1.0-0123456789ab").is_dir() and not any((root / "torch-1.0-0123456789ab").iterdir())

    second, _ = run_child({"TORCHRLHF_COMPILE_CACHE": str(root)})
    assert second["hits"] >= 1, "the second process compiled again instead of loading the cache"
    assert second["out"] == first["out"]

    # Every cache file cut to half its bytes: the third process recompiles, with the same result.
    corrupted = 0
    for f in (path / "inductor").rglob("*"):
        if f.is_file() and f.stat().st_size > 1:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            corrupted += 1
    assert corrupted
    # (Without the manifest check inductor loads a truncated generated module and raises a SyntaxError.)
    third, log = run_child({"TORCHRLHF_COMPILE_CACHE": str(root)})
    assert third["out"] == pytest.approx(reference(), abs=1e-5)
    assert f"{corrupted} file(s) changed since they were written" in log


def clear_torch_cache_env(monkeypatch) -> None:
    """Unset torch's cache variables for this test; what the code under test sets is undone after it."""
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, "-")  # records the value to restore, set or not
        monkeypatch.delenv(name)


def test_a_stamp_of_another_machine_starts_the_cache_afresh(tmp_path, monkeypatch, caplog):
    from torchrlhf.utils import compile_cache

    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    clear_torch_cache_env(monkeypatch)
    compile_cache.enable_compile_cache.cache_clear()
    path = tmp_path / compile_cache._key(compile_cache.machine_stamp())
    (path / "inductor").mkdir(parents=True)
    (path / "inductor" / "stale").write_text("from elsewhere")
    (path / "stamp.json").write_text(json.dumps({"torch": "0.0", "cpu": "another"}))
    try:
        assert compile_cache.enable_compile_cache() == path
    finally:
        compile_cache.enable_compile_cache.cache_clear()
    assert "starting it afresh" in caplog.text
    assert not (path / "inductor" / "stale").exists()
    assert json.loads((path / "stamp.json").read_text()) == compile_cache.machine_stamp()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path / "inductor")


def test_machines_of_one_cpu_model_with_other_vector_instructions_get_other_caches():
    """Two virtual machines named "AMD EPYC", one shown AVX-512 and one not, must not share kernels: one built with
    AVX-512 kills a process that loads it on the other."""
    from torchrlhf.utils.compile_cache import cpu_isa

    flags = "fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 smep bmi2"
    plain = f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n"
    wide = plain.replace("avx2", "avx2 avx512f avx512bw avx512_bf16")
    assert cpu_isa(plain) == "avx avx2 f16c fma sse sse2 sse4_1 sse4_2 ssse3"
    assert cpu_isa(wide) == "avx avx2 avx512_bf16 avx512bw avx512f f16c fma sse sse2 sse4_1 sse4_2 ssse3"
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve sve2 bf16 i8mm\n"
    assert cpu_isa(arm) == "asimd bf16 i8mm sve sve2"


@pytest.mark.parametrize("setting", ["off", "user_dir", "unusable"])
def test_torch_defaults_stay_when_asked(tmp_path, monkeypatch, caplog, setting):
    """``TORCHRLHF_COMPILE_CACHE=""``, a ``TORCHINDUCTOR_CACHE_DIR`` of the user's, or a cache directory that cannot
    be made (a warning says so): nothing is changed."""
    from torchrlhf.utils import compile_cache

    if setting == "off":
        monkeypatch.setenv(compile_cache.ENV, "")
        clear_torch_cache_env(monkeypatch)
    elif setting == "user_dir":
        monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "ours"))
        clear_torch_cache_env(monkeypatch)
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    else:
        (tmp_path / "a_file").write_text("")
        monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "a_file" / "ours"))
        clear_torch_cache_env(monkeypatch)
    compile_cache.enable_compile_cache.cache_clear()
    try:
        assert compile_cache.enable_compile_cache() is None
    finally:
        compile_cache.enable_compile_cache.cache_clear()
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == (str(tmp_path / "mine") if setting == "user_dir" else None)
    assert not (tmp_path / "ours").exists()
    assert ("unusable" in caplog.text) == (setting == "unusable")


@pytest.mark.parametrize("manifest", ["{not json", '{"inductor/a": 5}'])
def test_a_manifest_that_is_not_ours_starts_the_kernels_afresh(tmp_path, monkeypatch, caplog, manifest):
    from torchrlhf.utils import compile_cache

    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    clear_torch_cache_env(monkeypatch)
    path = tmp_path / compile_cache._key(compile_cache.machine_stamp())
    (path / "inductor").mkdir(parents=True)
    (path / "inductor" / "a").write_text("kernel")
    (path / "stamp.json").write_text(json.dumps(compile_cache.machine_stamp()))
    (path / "manifest.json").write_text(manifest)
    compile_cache.enable_compile_cache.cache_clear()
    try:
        assert compile_cache.enable_compile_cache() == path
    finally:
        compile_cache.enable_compile_cache.cache_clear()
    assert "manifest is unreadable" in caplog.text
    assert not (path / "inductor" / "a").exists() and not (path / "manifest.json").exists()


# A method compiled ahead in a fresh process: prints its results on two shapes, how many times this process
# compiled it, and the compile cache's log.
MODULE = textwrap.dedent("""
    import torch
    SCALE = {scale}
    class Step:
        def __init__(self):
            self.weight = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
        def step(self, x, n: int):
            return (x @ self.weight.T).sin().mul(SCALE).relu().sum(-1) * n
""")
CHILD_AHEAD = textwrap.dedent("""
    import json, logging, torch
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from torchrlhf.utils import compile_cache
    from aheadmod import Step
    compiles = []
    compile_ = compile_cache._CompiledAhead._compile
    compile_cache._CompiledAhead._compile = lambda self, *a: compiles.append(1) or compile_(self, *a)
    from torch._inductor.cpu_vec_isa import VecISA
    probes = []  # inductor's build-and-load probes of a vector ISA (not its further checks of AVX-512's bf16 and
    # VNNI or of AMX, which `config.cpp.vec_isa_ok` does not cover: they build on such a CPU in every process)
    check_build = VecISA.check_build
    VecISA.check_build = lambda self, code: (code == VecISA._avx_code and probes.append(str(self))) or check_build(
        self, code)
    f = compile_cache.compile_ahead(Step().step, "step", dynamic=True)
    outs = [f(torch.linspace(-2, 2, 6 * rows).view(rows, 6), n).tolist() for rows, n in ((4, 2), (7, 3))]
    print(json.dumps({"outs": outs, "compiles": len(compiles), "probes": probes}))
""")


def reference_step(scale: float) -> list[list[float]]:
    import torch

    weight = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    return [((torch.linspace(-2, 2, 6 * rows).view(rows, 6) @ weight.T).sin() * scale).relu().sum(-1).mul(n).tolist()
            for rows, n in ((4, 2), (7, 3))]


def test_a_function_compiled_ahead_is_loaded_by_the_next_process_unless_its_code_or_file_changed(tmp_path):
    """`compile_ahead` saves Dynamo's whole compilation: the second process runs it without compiling (both shapes,
    one dynamic variant). A changed module constant, which Dynamo's saved guards do not cover, makes it compile
    again, and so does a truncated or unreadable file: the results are always the code's own."""
    root, code = tmp_path / "compile", tmp_path / "code"
    code.mkdir()
    module = code / "aheadmod.py"
    module.write_text(MODULE.format(scale=3.0))
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(TORCHRLHF_COMPILE_CACHE=str(root), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join([str(code), env.get("PYTHONPATH", "")]))

    def run() -> tuple[dict, str]:
        out = subprocess.run([sys.executable, "-c", CHILD_AHEAD], env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr

    def close(outs, expected) -> bool:
        return all(a == pytest.approx(b, abs=1e-4) for a, b in zip(outs, expected, strict=True))

    first, _ = run()
    assert first["compiles"] == 1 and close(first["outs"], reference_step(3.0))
    saved = list(root.rglob("ahead/step-*/*.bin"))
    assert len(saved) == 1
    second, _ = run()
    assert second["compiles"] == 0, "the second process compiled again instead of loading the saved function"
    assert second["outs"] == first["outs"]
    if platform.machine() in ("x86_64", "AMD64"):  # the first process probed the ISAs; the second knew their answer
        passed = json.loads(next(root.rglob("vec_isa.json")).read_text())["passed"]
        assert first["probes"] and passed and set(passed) <= set(first["probes"])
        assert second["probes"] == []

    module.write_text(MODULE.format(scale=4.25))  # outside the traced lines: only the module's text tells
    third, log = run()
    assert third["compiles"] == 1 and close(third["outs"], reference_step(4.25))
    assert "traced from code that has changed since" in log

    (saved := list(root.rglob("ahead/step-*/*.bin")))[0].write_bytes(b"")  # recorded at exit: the manifest tells
    (saved[0].parent / "9-1.bin").write_bytes(b"not a pickle")  # never recorded: loading it fails
    fourth, log = run()
    assert fourth["compiles"] == 1 and close(fourth["outs"], reference_step(4.25))
    assert "file(s) changed since they were written" in log and "could not load" in log and "9-1.bin" in log
