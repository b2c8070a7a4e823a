"""rlog: the lowest layer of mnesite: vocabulary, wire codec, log store and the client."""

from mnesite.rlog.types import GENESIS_DIGEST, ZERO_KEY, CreateTableOp, DeleteOp, Entry, TxKey, WriteOp

__all__ = ["GENESIS_DIGEST", "ZERO_KEY", "CreateTableOp", "DeleteOp", "Entry", "TxKey", "WriteOp"]
