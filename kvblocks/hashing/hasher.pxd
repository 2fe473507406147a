# Cython declarations for the compiled build (docs/native.md): the hasher and a sequence's hashed tokens as
# extension types with Python-object fields (every field of each class declared here).
cdef class BlockHasher:
    cdef public object _block_dtype, block_size, lookahead, namespace, root, scheme

cdef class HashedTokens:
    cdef public object _framer, _hasher, _phase, _size, _tokens, hashes, num_tokens
    cpdef append_token(self, token)
