"""The C++ kernels' library is cached under a key of everything its machine code depends on:
a CPU with another instruction set gets its own build, even under the same model name."""

import subprocess
import sys

from jtree.kernels.cpu import library as cpu_library

CPUINFO = """processor\t: {n}
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx avx2 fma{extra}
"""


def _write(path, extra: str):
    path.write_text("\n".join(CPUINFO.format(n=n, extra=extra) for n in range(2)))
    return path


def test_cpu_identity_reads_the_model_name_and_the_instruction_set(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_library, "_CPUINFO", _write(tmp_path / "cpuinfo", " avx512f"))
    assert cpu_library.cpu_identity() == ("Intel(R) Xeon(R) Processor",
                                          "fpu sse2 avx avx2 fma avx512f")
    monkeypatch.setattr(cpu_library, "_CPUINFO", tmp_path / "missing")
    model, flags = cpu_library.cpu_identity()
    assert model and flags == ""


def test_the_same_model_name_with_another_instruction_set_is_another_build(tmp_path,
                                                                           monkeypatch):
    keys = []
    for name, extra in (("a", " avx512f"), ("b", ""), ("c", " avx512f")):
        monkeypatch.setattr(cpu_library, "_CPUINFO", _write(tmp_path / name, extra))
        keys.append(cpu_library.build_key())
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_loading_the_library_leaves_the_process_float_modes_alone():
    """Built with -ffast-math at link time, the library would switch the process to
    flush-to-zero when loaded, and numpy (and XLA) would then round subnormals to 0. Run in a
    fresh process: a library loaded earlier in this one would have changed the modes already."""
    probe = ("import numpy as np\n"
             "from jtree.kernels.cpu import library\n"
             "library.library()\n"
             "print(float((np.array([1e-310]) * 1.0)[0]))\n")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.strip()) == 1e-310
