// The manager's batch check in one pass (jax_kvxfer/_batch.py: check_batch), host code only.
//
// A manager call of 64 blocks costs about 200 us in all, of which reading and checking the
// pairs in NumPy took 16 us on the CPU machine and 36-75 us on the GPU hosts (a dozen small
// array operations, each mostly NumPy's fixed cost). Here it is one loop over the pairs.

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"

namespace nb = nanobind;

namespace kvxfer {
namespace {

using IndexColumns = nb::ndarray<int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using MemoryColumns = nb::ndarray<bool, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// A block's slot as KVCacheBlock._slot_code holds it (set at construction; the class is
// frozen): 2 * index + is_primary. An attribute that cannot be read is a bad block, except for
// exceptions that are not errors (KeyboardInterrupt, SystemExit), which propagate.
bool ReadSlotCode(PyObject* block, PyObject* name, int64_t* code) {
  PyObject* value = PyObject_GetAttr(block, name);
  if (value == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) throw nb::python_error();
    PyErr_Clear();
    return false;
  }
  int overflow = 0;
  const long long v = PyLong_Check(value) ? PyLong_AsLongLongAndOverflow(value, &overflow) : -1;
  Py_DECREF(value);
  if (PyErr_Occurred()) PyErr_Clear();
  *code = v;
  return overflow == 0 && v >= 0;
}

// Fills index[0] / primary[0] with the sources and index[1] / primary[1] with the destinations
// of `pairs` (a list of n (src, dst) tuples or lists of `block_type` instances), each block
// checked against its memory's block count. Returns (direction, unique_dst) as check_batch
// defines them, or None when some pair is not two blocks in range: the caller then names it
// (with the Python checks, which say what is wrong), and no pool has been touched.
nb::object SlotColumns(nb::list pairs, nb::type_object block_type, int64_t num_primary,
                       int64_t num_secondary, IndexColumns index, MemoryColumns primary) {
  const size_t n = nb::len(pairs);
  if (index.shape(0) != 2 || index.shape(1) != n || primary.shape(0) != 2 ||
      primary.shape(1) != n) {
    throw nb::value_error("slot_columns: index and primary must have shape (2, len(pairs))");
  }
  auto* const type = reinterpret_cast<PyTypeObject*>(block_type.ptr());
  static PyObject* const name = PyUnicode_InternFromString("_slot_code");
  int64_t* idx = index.data();
  bool* prim = primary.data();
  size_t primary_count[2] = {0, 0};  // sources, destinations in the primary memory
  std::vector<int64_t> dst_codes(n);
  for (size_t i = 0; i < n; ++i) {
    // Reading an attribute may run Python code that changes the list or a pair: the length is
    // checked again and the pair and its blocks are held by owned references.
    if (i >= static_cast<size_t>(PyList_GET_SIZE(pairs.ptr()))) return nb::none();
    nb::object pair = nb::borrow(PyList_GET_ITEM(pairs.ptr(), i));
    nb::object blocks[2];
    if (PyTuple_Check(pair.ptr()) && PyTuple_GET_SIZE(pair.ptr()) == 2) {
      blocks[0] = nb::borrow(PyTuple_GET_ITEM(pair.ptr(), 0));
      blocks[1] = nb::borrow(PyTuple_GET_ITEM(pair.ptr(), 1));
    } else if (PyList_Check(pair.ptr()) && PyList_GET_SIZE(pair.ptr()) == 2) {
      blocks[0] = nb::borrow(PyList_GET_ITEM(pair.ptr(), 0));
      blocks[1] = nb::borrow(PyList_GET_ITEM(pair.ptr(), 1));
    } else {
      return nb::none();
    }
    for (int role = 0; role < 2; ++role) {
      int64_t code = 0;
      if (!PyObject_TypeCheck(blocks[role].ptr(), type) ||
          !ReadSlotCode(blocks[role].ptr(), name, &code)) {
        return nb::none();
      }
      const bool is_primary = code & 1;
      if ((code >> 1) >= (is_primary ? num_primary : num_secondary)) return nb::none();
      idx[role * n + i] = code >> 1;
      prim[role * n + i] = is_primary;
      primary_count[role] += is_primary;
    }
    dst_codes[i] = idx[n + i] * 2 + prim[n + i];
  }
  std::sort(dst_codes.begin(), dst_codes.end());
  const bool unique_dst = std::adjacent_find(dst_codes.begin(), dst_codes.end()) == dst_codes.end();
  // One memory for every source and one for every destination: that pair; otherwise None.
  auto one = [n](size_t count) { return count == 0 || count == n; };
  nb::object direction = nb::none();
  if (n > 0 && one(primary_count[0]) && one(primary_count[1])) {
    direction = nb::make_tuple(primary_count[0] == n, primary_count[1] == n);
  }
  return nb::make_tuple(direction, unique_dst);
}

}  // namespace

void DefineSlotColumns(nb::module_& m) {
  // noconvert: an array of another dtype or layout would be copied, and the copy filled.
  m.def("slot_columns", &SlotColumns, nb::arg("pairs"), nb::arg("block_type"),
        nb::arg("num_primary"), nb::arg("num_secondary"), nb::arg("index").noconvert(),
        nb::arg("primary").noconvert());
}

}  // namespace kvxfer
