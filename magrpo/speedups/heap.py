"""What the process does with the CPU memory that freed tensors leave: give it back to the
OS, or keep it for the next tensors (glibc's allocator; elsewhere both are no-ops).

Memory that goes back to the OS comes back through page faults, and on a virtual machine
a fault is slow: ~2 ms per MB of fresh memory once the process holds a few GB
(``benchmarks/profile_step.py``), against ~0.04 ms per MB to refill memory already mapped.
glibc gives back every allocation above 32 MB as soon as it is freed (it maps those
separately), and the rest when the top of its heap is free or when we call
:func:`release_free_heap`. A full fine-tuning step frees and re-allocates about 2 GB per step
(each model's gradients, their packed decode copies), so keeping freed memory makes it ~16%
faster for ~4% more resident memory (over 40 steps it followed the high-water mark of the
longest prompt so far, plus fragmentation, and stayed flat in between); a LoRA
step re-allocates less than 1 GB and keeping it costs 11-14% more memory, so LoRA gives it
back. ``MAGRPOConfig.cpu_heap`` chooses.
"""

from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1


def _glibc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc
        return None


_LIBC = _glibc()
_keeping = False


def keep_freed_memory() -> bool:
    """From now on, keep freed memory in the process for the next allocations.

    Large allocations come from the heap instead of their own mappings and the heap is no
    longer trimmed, so sampling and the update reuse each other's pages. New threads (the
    decode workers of ``threads``) get no heaps ("arenas") of their own, whose freed memory
    only they would reuse. Resident memory then stays at its high-water mark (plus some
    fragmentation). Process-wide and not undone.
    Returns whether it took effect (False without glibc).
    """
    global _keeping
    if _LIBC is None:
        return False
    _keeping = all(
        _LIBC.mallopt(option, value)
        for option, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _INT_MAX), (_M_ARENA_MAX, 1))
    )
    return _keeping


def release_free_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``), unless the
    process keeps freed memory (:func:`keep_freed_memory`).

    glibc keeps the memory of freed tensors for reuse, so a phase that allocates differently
    from the previous one (the decode loop's packed weights after the update's activations)
    adds its memory on top of the other's instead of reusing it. Costs ~1-80 ms.
    """
    if _LIBC is not None and not _keeping:
        _LIBC.malloc_trim(0)
