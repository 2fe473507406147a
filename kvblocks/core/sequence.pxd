# Cython declarations for the compiled build (docs/native.md): _Sequence as an extension type, so the step reads
# and writes its fields without a dictionary or descriptor lookup. Every field of the class must be declared
# here; the four counts are C integers (token counts, at most sys.maxsize: _NEVER), the rest Python objects.
# sequence.py stays the reference and the pure-Python fallback.
cdef class _Sequence:
    cdef public object content, lora_id, lora_name, pins, table, view
    cdef public Py_ssize_t lookahead, num_committed, num_covered, watch
    cdef public Py_ssize_t step_commit, step_cover, step_lookahead, step_mark
    cdef public object step_tokens
    cdef public object preempted, skip_read
