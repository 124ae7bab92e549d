// Package kvevents reads the KV-cache events that vLLM and SGLang publish
// over ZMQ (--kv-events-config): the wire decoding of a batch (decode.go),
// a ZMTP 3 subscriber and replay client (zmtp.go, subscriber.go) and the
// sequence bookkeeping that turns gaps, restarts and lost publishers into
// replays and clears (subscriber.go). What the events mean for placement
// is package kvindex's.
//
// A message is three frames, [topic, seq as 8 bytes big-endian, payload];
// the payload is msgpack [ts, events, data_parallel_rank] (a map with those
// keys is read too). An event is an array with its type first (vLLM up to
// 0.25) or a map keyed by "type" (vLLM 0.26, SGLang since mid-2026):
// BlockStored (block_hashes, parent_block_hash, token_ids, block_size,
// lora_id, medium, lora_name, ...), BlockRemoved (block_hashes, medium),
// AllBlocksCleared. Unknown fields and types are skipped; missing trailing
// fields are zero; a hash is a uint64, an int64 or bytes (the last 8).
package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Kind is an event's type.
type Kind uint8

// The event kinds tether acts on; others are counted and skipped.
const (
	Unknown Kind = iota
	Stored       // BlockStored
	Removed      // BlockRemoved
	Cleared      // AllBlocksCleared
)

func (k Kind) String() string {
	switch k {
	case Stored:
		return "BlockStored"
	case Removed:
		return "BlockRemoved"
	case Cleared:
		return "AllBlocksCleared"
	}
	return "unknown"
}

// Event is one decoded event. Its slices are reused by the next Decode
// into the same Batch.
type Event struct {
	Kind      Kind
	Hashes    []uint64 // block_hashes
	Parent    uint64   // parent_block_hash, when HasParent
	HasParent bool
	Tokens    []uint32 // token_ids (BlockStored)
	BlockSize int      // block_size (0: not sent)
	LoRA      string   // lora_name, else lora_id in decimal, else ""
	Medium    string   // "" (not sent) or "GPU": the device cache; else an offload tier
}

// OnDevice reports whether the event is about the device (GPU) cache, the
// one prefill reuses without a transfer.
func (e *Event) OnDevice() bool { return e.Medium == "" || e.Medium == "GPU" || e.Medium == "gpu" }

// Batch is one decoded message.
type Batch struct {
	Seq    uint64
	TS     float64
	Rank   int // data_parallel_rank; -1 when not sent
	Events []Event
}

// ErrMalformed wraps every decoding failure.
var ErrMalformed = errors.New("kvevents: malformed batch")

// Decoder decodes payloads, reusing its state between calls (not safe for
// concurrent use).
type Decoder struct {
	r   bytes.Reader
	d   *msgpack.Decoder
	key []byte
}

// NewDecoder returns a Decoder.
func NewDecoder() *Decoder {
	d := &Decoder{}
	d.d = msgpack.NewDecoder(&d.r)
	return d
}

// Decode decodes the payload p into b (b.Seq is left to the caller). On an
// error b holds what was decoded before it; the caller drops the batch.
func (dec *Decoder) Decode(p []byte, b *Batch) error {
	dec.r.Reset(p)
	dec.d.Reset(&dec.r)
	b.TS, b.Rank, b.Events = 0, -1, b.Events[:0]
	if err := dec.batch(b); err != nil {
		return fmt.Errorf("%w: %v", ErrMalformed, err)
	}
	return nil
}

func (dec *Decoder) batch(b *Batch) error {
	d := dec.d
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	if isMap(c) {
		n, err := d.DecodeMapLen()
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			k, err := dec.keyString()
			if err != nil {
				return err
			}
			switch string(k) {
			case "ts":
				err = dec.ts(b)
			case "events":
				err = dec.events(b)
			case "data_parallel_rank":
				err = dec.rank(b)
			default:
				err = d.Skip()
			}
			if err != nil {
				return err
			}
		}
		return nil
	}
	n, err := d.DecodeArrayLen()
	if err != nil {
		return err
	}
	if n < 2 {
		return fmt.Errorf("batch of %d fields", n)
	}
	if err := dec.ts(b); err != nil {
		return err
	}
	if err := dec.events(b); err != nil {
		return err
	}
	if n > 2 {
		if err := dec.rank(b); err != nil {
			return err
		}
	}
	for i := 3; i < n; i++ {
		if err := d.Skip(); err != nil {
			return err
		}
	}
	return nil
}

func (dec *Decoder) ts(b *Batch) error {
	c, err := dec.d.PeekCode()
	if err != nil {
		return err
	}
	if c == msgpcode.Nil {
		return dec.d.DecodeNil()
	}
	b.TS, err = dec.d.DecodeFloat64()
	return err
}

func (dec *Decoder) rank(b *Batch) error {
	c, err := dec.d.PeekCode()
	if err != nil {
		return err
	}
	if c == msgpcode.Nil {
		return dec.d.DecodeNil()
	}
	r, err := dec.d.DecodeInt64()
	if err != nil {
		return err
	}
	if r < 0 || r > 1<<16 {
		return fmt.Errorf("data_parallel_rank %d", r)
	}
	b.Rank = int(r)
	return nil
}

func (dec *Decoder) events(b *Batch) error {
	n, err := dec.d.DecodeArrayLen()
	if err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		if len(b.Events) < cap(b.Events) {
			b.Events = b.Events[:len(b.Events)+1]
		} else {
			b.Events = append(b.Events, Event{})
		}
		e := &b.Events[len(b.Events)-1]
		e.Kind, e.Hashes, e.Parent, e.HasParent = Unknown, e.Hashes[:0], 0, false
		e.Tokens, e.BlockSize, e.LoRA, e.Medium = e.Tokens[:0], 0, "", ""
		if err := dec.event(e); err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
	}
	return nil
}

// The fields of the array forms, after the type.
var (
	storedFields  = [...]string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}
	removedFields = [...]string{"block_hashes", "medium"}
)

func (dec *Decoder) event(e *Event) error {
	d := dec.d
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case isMap(c):
		n, err := d.DecodeMapLen()
		if err != nil {
			return err
		}
		var loraID string
		for i := 0; i < n; i++ {
			k, err := dec.keyString()
			if err != nil {
				return err
			}
			if string(k) == "type" {
				t, err := dec.keyString()
				if err != nil {
					return err
				}
				e.Kind = kindOf(t)
				continue
			}
			if string(k) == "lora_id" {
				if loraID, err = dec.loraID(); err != nil {
					return err
				}
				continue
			}
			if err := dec.field(e, string(k)); err != nil {
				return fmt.Errorf("%s: %w", k, err)
			}
		}
		if e.LoRA == "" {
			e.LoRA = loraID
		}
		return nil
	case isArray(c):
		n, err := d.DecodeArrayLen()
		if err != nil {
			return err
		}
		if n < 1 {
			return errors.New("empty event")
		}
		t, err := dec.keyString()
		if err != nil {
			return err
		}
		e.Kind = kindOf(t)
		var names []string
		switch e.Kind {
		case Stored:
			names = storedFields[:]
		case Removed:
			names = removedFields[:]
		}
		var loraID string
		for i := 1; i < n; i++ {
			if i-1 >= len(names) {
				if err := d.Skip(); err != nil {
					return err
				}
				continue
			}
			name := names[i-1]
			if name == "lora_id" {
				if loraID, err = dec.loraID(); err != nil {
					return err
				}
				continue
			}
			if err := dec.field(e, name); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
		}
		if e.LoRA == "" {
			e.LoRA = loraID
		}
		return nil
	}
	return d.Skip() // neither form: unknown
}

func (dec *Decoder) field(e *Event, name string) error {
	d := dec.d
	switch name {
	case "block_hashes":
		n, err := d.DecodeArrayLen()
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			h, ok, err := dec.hash()
			if err != nil {
				return err
			}
			if !ok {
				return errors.New("nil block hash")
			}
			e.Hashes = append(e.Hashes, h)
		}
		return nil
	case "parent_block_hash":
		h, ok, err := dec.hash()
		e.Parent, e.HasParent = h, ok
		return err
	case "token_ids":
		n, err := d.DecodeArrayLen()
		if err != nil {
			return err
		}
		for i := 0; i < n; i++ {
			t, err := d.DecodeInt64()
			if err != nil {
				return err
			}
			if t < 0 || t > 1<<32-1 {
				return fmt.Errorf("token id %d", t)
			}
			e.Tokens = append(e.Tokens, uint32(t))
		}
		return nil
	case "block_size":
		c, err := d.PeekCode()
		if err != nil {
			return err
		}
		if c == msgpcode.Nil {
			return d.DecodeNil()
		}
		n, err := d.DecodeInt64()
		if err != nil {
			return err
		}
		if n < 0 || n > 1<<20 {
			return fmt.Errorf("block size %d", n)
		}
		e.BlockSize = int(n)
		return nil
	case "medium":
		s, err := dec.optString()
		e.Medium = s
		return err
	case "lora_name":
		s, err := dec.optString()
		e.LoRA = s
		return err
	}
	return d.Skip()
}

// hash reads a block hash: an integer (two's complement as uint64), or
// bytes or a string (the last 8 bytes, big-endian); ok false for nil.
func (dec *Decoder) hash() (uint64, bool, error) {
	d := dec.d
	c, err := d.PeekCode()
	if err != nil {
		return 0, false, err
	}
	switch {
	case c == msgpcode.Nil:
		return 0, false, d.DecodeNil()
	case msgpcode.IsBin(c) || msgpcode.IsString(c):
		b, err := d.DecodeBytes()
		if err != nil {
			return 0, false, err
		}
		return lastEight(b), true, nil
	}
	h, err := d.DecodeUint64()
	return h, err == nil, err
}

func lastEight(b []byte) uint64 {
	if len(b) >= 8 {
		return binary.BigEndian.Uint64(b[len(b)-8:])
	}
	var x [8]byte
	copy(x[8-len(b):], b)
	return binary.BigEndian.Uint64(x[:])
}

func (dec *Decoder) loraID() (string, error) {
	c, err := dec.d.PeekCode()
	if err != nil {
		return "", err
	}
	if c == msgpcode.Nil {
		return "", dec.d.DecodeNil()
	}
	if msgpcode.IsString(c) {
		return dec.d.DecodeString()
	}
	n, err := dec.d.DecodeInt64()
	if err != nil {
		return "", err
	}
	return strconv.FormatInt(n, 10), nil
}

func (dec *Decoder) optString() (string, error) {
	c, err := dec.d.PeekCode()
	if err != nil {
		return "", err
	}
	if c == msgpcode.Nil {
		return "", dec.d.DecodeNil()
	}
	if !msgpcode.IsString(c) && !msgpcode.IsBin(c) {
		return "", dec.d.Skip()
	}
	return dec.d.DecodeString()
}

// keyString reads a string into dec.key (valid until the next call).
func (dec *Decoder) keyString() ([]byte, error) {
	c, err := dec.d.PeekCode()
	if err != nil {
		return nil, err
	}
	if !msgpcode.IsString(c) && !msgpcode.IsBin(c) {
		return nil, fmt.Errorf("want a string, code %#x", c)
	}
	n, err := dec.d.DecodeBytesLen()
	if err != nil {
		return nil, err
	}
	if n < 0 || n > 1<<10 {
		return nil, fmt.Errorf("key of %d bytes", n)
	}
	if cap(dec.key) < n {
		dec.key = make([]byte, n)
	}
	dec.key = dec.key[:n]
	if err := dec.d.ReadFull(dec.key); err != nil {
		return nil, err
	}
	return dec.key, nil
}

func kindOf(t []byte) Kind {
	switch string(t) {
	case "BlockStored":
		return Stored
	case "BlockRemoved":
		return Removed
	case "AllBlocksCleared":
		return Cleared
	}
	return Unknown
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}
