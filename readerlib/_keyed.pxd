# Batches and instances keyed by field name (readerlib/_keyed.pyx): what
# compiled readers cimport to build them.  An item is a tuple subclass, one
# class per (batch or instance, field names); these fill one without copying
# the values into an intermediate tuple.

# The Batch (batch=True) or Instance class of a schema (cached by identity).
cdef object keyed_type(object schema, bint batch)
# A new item of class `cls` with n empty slots: fill every one with
# Py_INCREF + PyTuple_SET_ITEM before anyone sees it.
cdef object keyed_new(object cls, Py_ssize_t n)
# A new item of class `cls` holding `values` (a list or tuple, field order).
cdef object keyed_from_seq(object cls, object values)
# keyed_from_seq(keyed_type(schema, batch), values)
cdef object keyed_of(object schema, bint batch, object values)
