"""process.v1 at run time: message classes from the descriptor process.proto compiles to.

agnsup does not ship generated `_pb2` modules: `_descriptor.py` holds the
serialized FileDescriptorProto of process.proto (written by
scripts/gen_sandboxd_descriptor), and `messages()` builds the classes from it
in a descriptor pool of agnsup's own, so a client package's generated stubs
for the same file (k8s-agent-sandbox ships them) can live in the same process
without a "duplicate file" clash in protobuf's default pool. Needs only
protobuf (a grpcio dependency); protoc is needed only to regenerate.
"""
from __future__ import annotations

import functools
import os
import types

PROTO_NAME = "process/v1/process.proto"  # the name the standard's file has in every pool
SERVICE = "process.v1.ProcessService"
MESSAGES = ("PTY", "ProcessConfig", "StartRequest", "InitEvent", "ExitEvent", "StartResponse", "ExecuteRequest",
            "ExecuteResponse", "ExecuteWithLimitsRequest", "ExecuteWithLimitsResponse", "WriteStdinRequest",
            "WriteStdinResponse", "SendSignalRequest", "SendSignalResponse", "ResizeTTYRequest", "ResizeTTYResponse")


@functools.cache
def messages() -> types.SimpleNamespace:
    """pb.ExecuteRequest, pb.StartResponse, ..., pb.Signal and pb.ExecuteTerminationReason (name -> number)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, duration_pb2, empty_pb2, message_factory

    from ._descriptor import FILE
    pool = descriptor_pool.DescriptorPool()
    for wellknown in (duration_pb2, empty_pb2):
        dep = descriptor_pb2.FileDescriptorProto()
        wellknown.DESCRIPTOR.CopyToProto(dep)
        pool.Add(dep)
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(FILE))
    ns = types.SimpleNamespace(**{m: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"process.v1.{m}"))
                                  for m in MESSAGES})
    sig = pool.FindEnumTypeByName("process.v1.Signal")
    ns.Signal = {v.name: v.number for v in sig.values}
    ns.ExecuteTerminationReason = {v.name: v.number
                                   for v in pool.FindEnumTypeByName("process.v1.ExecuteTerminationReason").values}
    ns.Empty = message_factory.GetMessageClass(pool.FindMessageTypeByName("google.protobuf.Empty"))
    ns.pool = pool
    return ns


def compile_proto(path: str) -> bytes:
    """process.proto -> its serialized FileDescriptorProto, with grpcio-tools' protoc (in process)."""
    import shutil
    import tempfile

    import grpc_tools
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, os.path.dirname(PROTO_NAME)))
        shutil.copy(path, os.path.join(tmp, PROTO_NAME))
        out = os.path.join(tmp, "set.pb")
        include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        rc = protoc.main(["protoc", f"-I{tmp}", f"-I{include}", f"--descriptor_set_out={out}", PROTO_NAME])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {path} (exit {rc})")
        with open(out, "rb") as f:
            fds = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    (fd,) = fds.file
    return fd.SerializeToString(deterministic=True)


def descriptor_module(serialized: bytes) -> str:
    lines = [f"    {serialized[i:i + 64]!r}" for i in range(0, len(serialized), 64)]
    return ('"""The serialized FileDescriptorProto of process.proto: written by scripts/gen_sandboxd_descriptor,\n'
            'do not edit (tests/test_sandboxd.py checks it matches the .proto)."""\n'
            "FILE = (\n" + "\n".join(lines) + "\n)\n")
