# Cython declarations for the compiled build (docs/native.md): the builder's per-sequence loop reads a sequence's
# fields from its struct (step_metadata.py stays the reference and the pure-Python fallback).
cimport cython
from kvblocks.core.sequence cimport _Sequence

@cython.locals(s=_Sequence, start=Py_ssize_t)
cpdef tuple _collect_rows(builder, seq_ids, num_new_tokens)
