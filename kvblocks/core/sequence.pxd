# Cython declarations for the compiled build (docs/native.md): _Sequence as an extension type whose fields are
# Python objects, so the step reads and writes them without a dictionary or descriptor lookup. Every field of
# the class must be declared here; sequence.py stays the reference and the pure-Python fallback.
cdef class _Sequence:
    cdef public object content, lora_id, lora_name, pins, table, view
    cdef public object lookahead, num_committed, num_covered, watch
    cdef public object preempted, skip_read
