# Cython declarations for the compiled build (docs/native.md): a group's tier stack as an extension type, so its
# own methods read its fields from the object's struct. Every field of the class is declared here, each a Python
# object; stack.py stays the reference and the pure-Python fallback.
cdef class TierStack:
    cdef public object counts, events, host, host_back, host_through, number, plan, save_back, save_through
    cdef public object storage, tiers, wants_evicted, writes_through
