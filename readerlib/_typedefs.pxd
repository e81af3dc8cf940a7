# C types shared by every compiled module (scikit-learn's habit: one place).
from libc.stdint cimport (int8_t, int16_t, int32_t, int64_t,
                          uint8_t, uint16_t, uint32_t, uint64_t)

ctypedef float float32_t
ctypedef double float64_t
ctypedef Py_ssize_t intp_t

# Values a parallel loop may take its element type from.
ctypedef fused real_t:
    float32_t
    float64_t

ctypedef fused index_t:
    int32_t
    int64_t
