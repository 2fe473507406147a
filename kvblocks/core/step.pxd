# Cython declarations for the compiled build (docs/native.md): the step's sequence variable is a _Sequence and its
# token counts are C integers (step.py keeps every count within _MAX_COUNT before it reaches one).
cimport cython
from kvblocks.core.sequence cimport _Sequence
from kvblocks.hashing.hasher cimport HashedTokens

@cython.locals(s=_Sequence, hashed=HashedTokens, n=Py_ssize_t, new=Py_ssize_t, k=Py_ssize_t, committed=Py_ssize_t, slots=Py_ssize_t,
               appended=Py_ssize_t, mark=Py_ssize_t, covered=Py_ssize_t, i=Py_ssize_t, count=Py_ssize_t, need=Py_ssize_t, size=Py_ssize_t, known=Py_ssize_t)
cpdef list run_step(manager, seq_ids, num_computed_tokens, new_token_ids, num_new_tokens, num_lookahead_tokens)

@cython.locals(size=Py_ssize_t, before=Py_ssize_t, start=Py_ssize_t, stop=Py_ssize_t)
cpdef commit_checked(manager, _Sequence s, Py_ssize_t n)
