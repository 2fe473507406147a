# Cython declarations for the compiled build (docs/native.md): the admission as an extension type, so its own
# methods read its fields from the object's struct. Every field of the class is declared here, each a Python
# object; admission.py stays the reference and the pure-Python fallback.
cdef class Admission:
    cdef public object _beside, _block_size, _caching, _crosses, _drop_last, _full, _groups, _pool, _reserve
    cdef public object _tiers, _tree
