// The exception translator of both extension modules (_C and _mpi): core exceptions as Python's.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <new>
#include <stdexcept>

#include "hetpipe/errors.h"

namespace hetpipe::bindings {

// Registers the translator for the module being initialised. Module-local, and it handles every
// exception type the core throws, so pybind11 never offers them to the global translators that
// other extensions (torch among them) register in a shared pybind11 internals: a foreign translator
// built against another pybind11 or libstdc++ has been seen to crash on an exception it does not know.
inline void register_translator() {
  pybind11::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hetpipe::TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::out_of_range& e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(PyExc_MemoryError, "hetpipe_core: out of host memory");
    } catch (const pybind11::builtin_exception& e) {
      e.set_error();  // pybind11's own (value_error, type_error, buffer_error, ...)
    } catch (pybind11::error_already_set& e) {
      e.restore();  // a Python error (a signal's KeyboardInterrupt) carried through C++
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
}

}  // namespace hetpipe::bindings
