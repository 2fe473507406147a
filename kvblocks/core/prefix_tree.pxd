# Cython declarations for the compiled build (docs/native.md): the prefix tree as an extension type, so its own
# methods read its fields from the object's struct instead of through slot descriptors. Every field of the class
# is declared here, each a Python object; prefix_tree.py stays the reference and the pure-Python fallback.
cdef class PrefixTree:
    cdef public object _block_of, _events, _hash_of, _num_children, _parent_of, _removed, _root, _stored
    cdef public object _stored_range, _tokens_of, block_size, group, group_kind, lifetimes, num_evicted, pool, tier
