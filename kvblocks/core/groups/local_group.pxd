# Cython declarations for the compiled build (docs/native.md): the local group's manager as an extension type, so
# its own methods read its fields from the object's struct. Every field of the class is declared here, each a
# Python object; local_group.py stays the reference and the pure-Python fallback.
cdef class LocalGroupManager:
    cdef public object _inflight, _prompts, block_size, index, kind, number, pool, ratio, released, rule, span
    cdef public object tables, tiers
