# Cython declarations for the compiled build (docs/native.md): the prefix tree as an extension type, so its own
# methods read its fields from the object's struct instead of through slot descriptors. Every field of the class
# is declared here, each a Python object; prefix_tree.py stays the reference and the pure-Python fallback.
cimport cython
cdef class PrefixTree:
    cdef public object _block_of, _events, _hash_of, _num_children, _parent_of, _removed, _root, _stored
    cdef public object _stored_range, _tokens_of, block_size, group, group_kind, lifetimes, num_evicted, pool, tier

    # the insert loop: ids as C integers over typed lists (a bad id is refused alike: _link catches the OverflowError
    # a C conversion raises beside IndexError and TypeError)
    @cython.locals(i=Py_ssize_t, b=Py_ssize_t, hash_of=list, parent_of=list, num_children=list, ref=list)
    cpdef Py_ssize_t _link(self, hashes, blocks, Py_ssize_t first, Py_ssize_t stop, Py_ssize_t parent) except -1
