# Cython declarations for the compiled build (docs/native.md): the step's sequence variable is a _Sequence.
cimport cython
from kvblocks.core.sequence cimport _Sequence

@cython.locals(s=_Sequence)
cpdef list run_step(manager, seq_ids, num_computed_tokens, new_token_ids, num_new_tokens, num_lookahead_tokens)
