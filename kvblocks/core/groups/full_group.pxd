# Cython declarations for the compiled build (docs/native.md): the full-attention group as an extension type, so
# its own methods read its fields from the object's struct. Every field of the class is declared here, each a
# Python object; full_group.py stays the reference and the pure-Python fallback.
cdef class FullAttentionGroup:
    cdef public object block_size, caching, pool, tiers, tree
