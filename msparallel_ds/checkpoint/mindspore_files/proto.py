"""MindSpore's two protobuf messages (checkpoint.proto, node_strategy.proto), built at import time.

The message classes are made from a FileDescriptorProto assembled in code from the tables below, in a private
descriptor pool: no protoc, no generated _pb2 files (whose runtime checks break across protobuf versions), and no
clash with MindSpore's own classes when both are imported in one process. Field numbers, labels and types are those
of mindspore/train/checkpoint_pb2.py and node_strategy_pb2.py (MindSpore 2.7), so the bytes are the same.

    // checkpoint.proto (proto2, no package)
    message Checkpoint {
      message Value {
        required string tag = 1;
        oneof value { TensorProto tensor = 2; MapTensorProto maptensor = 3; }
      }
      repeated Value value = 1;
    }
    message TensorProto {
      repeated int64 dims = 1;
      required string tensor_type = 2;
      required bytes tensor_content = 3;
    }
    message MapTensorProto { repeated TensorProto tensor = 1; }

    // node_strategy.proto (proto2, package mindspore.straspb)
    message ParallelStrategy { repeated uint32 dim = 1; }
    message ParallelStrategys { required uint32 stage = 1; repeated ParallelStrategy parallel_strategy = 2; }
    message ParallelStrategyItem { required string node_name = 1; required ParallelStrategys parallel_strategys = 2; }
    message DevMatrix { repeated uint32 dim = 1; }
    message TensorMap { repeated int32 dim = 1; }
    message ParamSplitShape { repeated int64 dim = 1; }
    message IndicesOffset { repeated int64 dim = 1; }
    message ParallelLayouts {
      repeated DevMatrix dev_matrix = 1;
      repeated TensorMap tensor_map = 2;
      repeated ParamSplitShape param_split_shape = 3;
      repeated IndicesOffset indices_offset = 4;
      required int32 field = 5;
      required int32 opt_weight_shard_step = 6;
      required int32 opt_weight_shard_size = 7;
    }
    message ParallelLayoutItem { required string param_name = 1; required ParallelLayouts parallel_layouts = 2; }
    message ParallelGroupRanks { repeated uint32 dim = 1; }
    message ParallelGroupItem { required string group_name = 1; required ParallelGroupRanks parallel_group_ranks = 2; }
    message ParallelGroupMap {
      repeated ParallelGroupItem parallel_group_item = 1;
      required ParallelGroupRanks ckpt_restore_rank_list = 2;
    }
    message ParallelStrategyMap {
      required uint32 current_stage = 1;
      repeated ParallelStrategyItem parallel_strategy_item = 2;
      repeated ParallelLayoutItem parallel_layout_item = 3;
    }
"""
from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_LABEL = {"optional": _F.LABEL_OPTIONAL, "required": _F.LABEL_REQUIRED, "repeated": _F.LABEL_REPEATED}
_SCALAR = {"string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "int64": _F.TYPE_INT64, "int32": _F.TYPE_INT32,
           "uint32": _F.TYPE_UINT32}

# message -> [(label, type, name, number)]; a type not in _SCALAR is a message of this file (a nested one is "A.B").
# A fifth item names the oneof the field belongs to.
_CHECKPOINT = {
    "Checkpoint": [("repeated", "Checkpoint.Value", "value", 1)],
    "Checkpoint.Value": [("required", "string", "tag", 1), ("optional", "TensorProto", "tensor", 2, "value"),
                         ("optional", "MapTensorProto", "maptensor", 3, "value")],
    "TensorProto": [("repeated", "int64", "dims", 1), ("required", "string", "tensor_type", 2),
                    ("required", "bytes", "tensor_content", 3)],
    "MapTensorProto": [("repeated", "TensorProto", "tensor", 1)],
}
_STRATEGY = {
    "ParallelStrategy": [("repeated", "uint32", "dim", 1)],
    "ParallelStrategys": [("required", "uint32", "stage", 1), ("repeated", "ParallelStrategy", "parallel_strategy", 2)],
    "ParallelStrategyItem": [("required", "string", "node_name", 1),
                             ("required", "ParallelStrategys", "parallel_strategys", 2)],
    "DevMatrix": [("repeated", "uint32", "dim", 1)],
    "TensorMap": [("repeated", "int32", "dim", 1)],
    "ParamSplitShape": [("repeated", "int64", "dim", 1)],
    "IndicesOffset": [("repeated", "int64", "dim", 1)],
    "ParallelLayouts": [("repeated", "DevMatrix", "dev_matrix", 1), ("repeated", "TensorMap", "tensor_map", 2),
                        ("repeated", "ParamSplitShape", "param_split_shape", 3),
                        ("repeated", "IndicesOffset", "indices_offset", 4), ("required", "int32", "field", 5),
                        ("required", "int32", "opt_weight_shard_step", 6),
                        ("required", "int32", "opt_weight_shard_size", 7)],
    "ParallelLayoutItem": [("required", "string", "param_name", 1),
                           ("required", "ParallelLayouts", "parallel_layouts", 2)],
    "ParallelGroupRanks": [("repeated", "uint32", "dim", 1)],
    "ParallelGroupItem": [("required", "string", "group_name", 1),
                          ("required", "ParallelGroupRanks", "parallel_group_ranks", 2)],
    "ParallelGroupMap": [("repeated", "ParallelGroupItem", "parallel_group_item", 1),
                         ("required", "ParallelGroupRanks", "ckpt_restore_rank_list", 2)],
    "ParallelStrategyMap": [("required", "uint32", "current_stage", 1),
                            ("repeated", "ParallelStrategyItem", "parallel_strategy_item", 2),
                            ("repeated", "ParallelLayoutItem", "parallel_layout_item", 3)],
}


def _file_proto(name: str, package: str, table: dict) -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto(name=name, package=package, syntax="proto2")
    built: dict[str, descriptor_pb2.DescriptorProto] = {}
    for full in table:  # parents come before their nested messages in the tables
        outer, _, inner = full.rpartition(".")
        msg = built[outer].nested_type.add() if outer else fdp.message_type.add()
        msg.name = inner
        built[full] = msg
        oneofs: list[str] = []
        for label, typ, fname, number, *oneof in table[full]:
            fld = msg.field.add(name=fname, number=number, label=_LABEL[label])
            if typ in _SCALAR:
                fld.type = _SCALAR[typ]
            else:
                fld.type = _F.TYPE_MESSAGE
                fld.type_name = "." + ".".join(p for p in (package, typ) if p)
            if oneof:
                if oneof[0] not in oneofs:
                    oneofs.append(oneof[0])
                    msg.oneof_decl.add(name=oneof[0])
                fld.oneof_index = oneofs.index(oneof[0])
    return fdp


def _classes(fdp: descriptor_pb2.FileDescriptorProto, names) -> list:
    pool = descriptor_pool.DescriptorPool()  # private: MindSpore's own classes use these names in the default pool
    pool.AddSerializedFile(fdp.SerializeToString())
    prefix = fdp.package + "." if fdp.package else ""
    out = []
    for name in names:
        desc = pool.FindMessageTypeByName(prefix + name)
        if hasattr(message_factory, "GetMessageClass"):
            out.append(message_factory.GetMessageClass(desc))
        else:  # protobuf < 4.21
            out.append(message_factory.MessageFactory(pool).GetPrototype(desc))
    return out


Checkpoint, TensorProto, MapTensorProto = _classes(
    _file_proto("checkpoint.proto", "", _CHECKPOINT), ["Checkpoint", "TensorProto", "MapTensorProto"])
(ParallelStrategyMap, ParallelLayouts, ParallelLayoutItem, ParallelStrategyItem, ParallelGroupMap) = _classes(
    _file_proto("node_strategy.proto", "mindspore.straspb", _STRATEGY),
    ["ParallelStrategyMap", "ParallelLayouts", "ParallelLayoutItem", "ParallelStrategyItem", "ParallelGroupMap"])

__all__ = ["Checkpoint", "TensorProto", "MapTensorProto", "ParallelStrategyMap", "ParallelLayouts",
           "ParallelLayoutItem", "ParallelStrategyItem", "ParallelGroupMap"]
