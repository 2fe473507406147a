# Cython declarations for the compiled build (docs/native.md): the block pool as an extension type, so its own
# methods read its fields from the object's struct instead of through slot descriptors. Every field of the class
# is declared here, each a Python object; pool.py stays the reference and the pure-Python fallback.
cimport cython
cdef class BlockPool:
    cdef public object _eviction, _fresh, _idle, _key, _policy, _ref, _taken_at, clock, num_blocks

    # the unchecked halves of acquire / release: their ids are valid by construction, and counts are small ints
    @cython.locals(ref=list, b=Py_ssize_t, r=Py_ssize_t)
    cpdef _acquire_valid(self, blocks)

    @cython.locals(ref=list, key=list, b=Py_ssize_t, r=Py_ssize_t)
    cpdef _release_valid(self, blocks)
