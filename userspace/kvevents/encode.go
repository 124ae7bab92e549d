package kvevents

import (
	"encoding/binary"

	"github.com/vmihailenco/msgpack/v5"
)

// Form is a wire form of events, for publishers (the fake engine, tests).
type Form uint8

// The two forms engines send.
const (
	ArrayForm Form = iota // ["BlockStored", hashes, parent, tokens, size, lora_id, medium, lora_name]
	MapForm               // {"type": "BlockStored", "block_hashes": ...}
)

// HashForm is how a publisher writes block hashes.
type HashForm uint8

// vLLM's default (uint64), SGLang's (int64) and vLLM's raw digests.
const (
	HashUint HashForm = iota
	HashInt
	HashBytes
)

// Encode encodes a batch's payload in form f with hashes written as h.
func Encode(b *Batch, f Form, h HashForm) ([]byte, error) {
	evs := make([]any, 0, len(b.Events))
	for i := range b.Events {
		evs = append(evs, encodeEvent(&b.Events[i], f, h))
	}
	var rank any
	if b.Rank >= 0 {
		rank = b.Rank
	}
	return msgpack.Marshal([]any{b.TS, evs, rank})
}

func encodeHash(x uint64, h HashForm) any {
	switch h {
	case HashInt:
		return int64(x)
	case HashBytes:
		var d [32]byte // a 256-bit digest, its low 64 bits last
		binary.BigEndian.PutUint64(d[24:], x)
		d[0] = 0xa5
		return d[:]
	}
	return x
}

func encodeEvent(e *Event, f Form, h HashForm) any {
	hashes := make([]any, len(e.Hashes))
	for i, x := range e.Hashes {
		hashes[i] = encodeHash(x, h)
	}
	var parent any
	if e.HasParent {
		parent = encodeHash(e.Parent, h)
	}
	var medium, lora any
	if e.Medium != "" {
		medium = e.Medium
	}
	if e.LoRA != "" {
		lora = e.LoRA
	}
	switch e.Kind {
	case Stored:
		if f == MapForm {
			return map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
				"token_ids": e.Tokens, "block_size": e.BlockSize, "lora_id": nil, "medium": medium, "lora_name": lora}
		}
		return []any{"BlockStored", hashes, parent, e.Tokens, e.BlockSize, nil, medium, lora}
	case Removed:
		if f == MapForm {
			return map[string]any{"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
		}
		return []any{"BlockRemoved", hashes, medium}
	case Cleared:
		if f == MapForm {
			return map[string]any{"type": "AllBlocksCleared"}
		}
		return []any{"AllBlocksCleared"}
	}
	return nil
}
