"""The converters' glibc rule (DESIGN.md, "Converters and glibc's mmap threshold"): after
return_large_frees_to_the_os(), a 3 MiB block (one expert tensor of the Qwen3-30B-A3B shape) is
mmapped, so freeing it returns it to the OS, even after a larger mmapped block was freed; glibc's
default would have raised its threshold past it and served it from the retained heap."""

from __future__ import annotations

import ctypes.util
import platform
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, sys
from megatron_dapo.convert import return_large_frees_to_the_os

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "fixed":
    return_large_frees_to_the_os()
libc.free(libc.malloc(8 << 20))  # glibc's dynamic threshold rises to 8 MiB here
before = libc.mallinfo2().hblks
block = libc.malloc(3 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or ctypes.util.find_library("c") is None,
                    reason="the rule is glibc's")
def test_expert_sized_blocks_are_mmapped_after_a_larger_free():
    def mmapped(mode: str) -> int:
        # A process of its own: the setting is process-wide and would outlive the test.
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout)

    assert mmapped("default") == 0  # what the converters had: the heap, kept after free
    assert mmapped("fixed") == 1
