"""Imported by the RPC server's fork server (:data:`pit_tvm.tuning.rpc_server.SESSION_PRELOAD`):
registers the functions the PIT runner calls by name, so every session forked from it has them."""
from pit_tvm.tuning._worker import register_server_functions

register_server_functions()
