# Cython declarations for the compiled build (docs/native.md): the host tier as an extension type, so its own
# methods read its fields from the object's struct. Every field of the class is declared here, each a Python
# object; host.py stays the reference and the pure-Python fallback.
cdef class HostTier:
    cdef public object _block_of, _chains, _events, _log, _pending, _removed, _stored, block_size, group
    cdef public object group_kind, num_evicted, pool
