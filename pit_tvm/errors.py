"""The user-error exception of pit-tvm.

:class:`UserError` marks a problem with what the user gave (a file, an argument, an input
array), as opposed to a bug. The message names the problem in one line; the ``pit-tvm`` command
line prints it as ``pit-tvm <command>: error: <message>`` and exits with code 2 instead of a
traceback. It is a ``ValueError``, so code catching ``ValueError`` keeps working.

Registered with ``tvm_ffi`` so that one raised inside a pass or callback run through TVM's FFI
comes out as a ``UserError`` again, not as a ``RuntimeError``. Runtime-safe: ``pit_tvm.runtime``
raises it too.
"""


class UserError(ValueError):
    """Bad input from the user: a file that is not what it should be, an invalid argument, an
    input array that does not fit the model. Reported without a traceback by the CLI."""


try:
    import tvm_ffi
except ImportError:  # pragma: no cover - tvm_ffi comes with TVM
    pass
else:
    tvm_ffi.register_error(UserError)


__all__ = ["UserError"]
