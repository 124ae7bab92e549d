package kvevents

import (
	"errors"
	"reflect"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

func mustMarshal(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDecodeForms(t *testing.T) {
	digest := make([]byte, 32)
	digest[31], digest[24] = 7, 1 // last 8 bytes: 0x0100000000000007
	tests := []struct {
		name    string
		payload any
		want    Batch
		wantErr bool
	}{
		{
			name: "array form, vLLM 0.23 with uint64 hashes",
			payload: []any{1.5, []any{
				[]any{"BlockStored", []any{uint64(1 << 63), uint64(2)}, nil, []int{1, 2, 3, 4}, 2, nil, "GPU"},
				[]any{"BlockRemoved", []any{uint64(2)}, "GPU"},
				[]any{"AllBlocksCleared"},
			}, 3},
			want: Batch{TS: 1.5, Rank: 3, Events: []Event{
				{Kind: Stored, Hashes: []uint64{1 << 63, 2}, Tokens: []uint32{1, 2, 3, 4}, BlockSize: 2, Medium: "GPU"},
				{Kind: Removed, Hashes: []uint64{2}, Medium: "GPU"},
				{Kind: Cleared},
			}},
		},
		{
			name: "map form, SGLang int64 hashes, parent, lora name, unknown fields",
			payload: []any{int64(2), []any{
				map[string]any{"type": "BlockStored", "block_hashes": []any{int64(-1)}, "parent_block_hash": int64(-2),
					"token_ids": []int{9, 9}, "block_size": 2, "lora_id": 4, "medium": nil, "extra_keys": []any{"x"},
					"group_idx": 0, "kv_cache_spec_kind": "full"},
				map[string]any{"type": "BlockRemoved", "block_hashes": []any{int64(-1)}, "medium": "CPU", "group_idx": 0},
				map[string]any{"type": "SomethingNew", "x": []any{1, 2}},
			}, nil},
			want: Batch{TS: 2, Rank: -1, Events: []Event{
				{Kind: Stored, Hashes: []uint64{^uint64(0)}, Parent: ^uint64(1), HasParent: true, Tokens: []uint32{9, 9}, BlockSize: 2, LoRA: "4"},
				{Kind: Removed, Hashes: []uint64{^uint64(0)}, Medium: "CPU"},
				{Kind: Unknown},
			}},
		},
		{
			name: "byte digests: the last 8 bytes; lora_name wins over lora_id; missing trailing fields",
			payload: []any{0.0, []any{
				[]any{"BlockStored", []any{digest}, digest, []int{5}, 1, 3, "GPU", "math-lora", []any{}, 0},
				[]any{"BlockStored", []any{digest}},
			}},
			want: Batch{Rank: -1, Events: []Event{
				{Kind: Stored, Hashes: []uint64{0x0100000000000007}, Parent: 0x0100000000000007, HasParent: true, Tokens: []uint32{5}, BlockSize: 1, Medium: "GPU", LoRA: "math-lora"},
				{Kind: Stored, Hashes: []uint64{0x0100000000000007}},
			}},
		},
		{
			name:    "batch as a map",
			payload: map[string]any{"ts": 3.0, "events": []any{[]any{"AllBlocksCleared"}}, "data_parallel_rank": 1, "new": "x"},
			want:    Batch{TS: 3, Rank: 1, Events: []Event{{Kind: Cleared}}},
		},
		{name: "not msgpack", payload: nil, wantErr: true},
		{name: "one field", payload: []any{1.0}, wantErr: true},
		{name: "events not a list", payload: []any{1.0, "x"}, wantErr: true},
		{name: "event type not a string", payload: []any{1.0, []any{[]any{7}}}, wantErr: true},
		{name: "negative token", payload: []any{1.0, []any{[]any{"BlockStored", []any{1}, nil, []int{-1}, 1}}}, wantErr: true},
		{name: "nil block hash", payload: []any{1.0, []any{[]any{"BlockRemoved", []any{nil}}}}, wantErr: true},
	}
	dec := NewDecoder()
	var b Batch
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := []byte{0xc1} // never used in msgpack
			if tt.payload != nil {
				p = mustMarshal(t, tt.payload)
			}
			err := dec.Decode(p, &b)
			if tt.wantErr {
				if !errors.Is(err, ErrMalformed) {
					t.Fatalf("err = %v, want ErrMalformed", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := normalize(b)
			if !reflect.DeepEqual(got, normalize(tt.want)) {
				t.Fatalf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

// normalize makes empty slices nil (reused slices are empty, not nil).
func normalize(b Batch) Batch {
	out := b
	out.Events = nil
	for _, e := range b.Events {
		if len(e.Hashes) == 0 {
			e.Hashes = nil
		}
		if len(e.Tokens) == 0 {
			e.Tokens = nil
		}
		out.Events = append(out.Events, e)
	}
	return out
}

func TestEncodeRoundTrip(t *testing.T) {
	in := Batch{TS: 1, Rank: 2, Events: []Event{
		{Kind: Stored, Hashes: []uint64{1 << 62, 5}, Parent: 9, HasParent: true, Tokens: []uint32{1, 2, 3, 4}, BlockSize: 2, LoRA: "l", Medium: "GPU"},
		{Kind: Removed, Hashes: []uint64{5}},
		{Kind: Cleared},
	}}
	dec := NewDecoder()
	for _, f := range []Form{ArrayForm, MapForm} {
		for _, h := range []HashForm{HashUint, HashInt, HashBytes} {
			p, err := Encode(&in, f, h)
			if err != nil {
				t.Fatal(err)
			}
			var out Batch
			if err := dec.Decode(p, &out); err != nil {
				t.Fatalf("form %d hash %d: %v", f, h, err)
			}
			if !reflect.DeepEqual(normalize(out), normalize(in)) {
				t.Fatalf("form %d hash %d:\ngot  %+v\nwant %+v", f, h, out, in)
			}
		}
	}
}

func FuzzDecode(f *testing.F) {
	in := Batch{TS: 1, Rank: 0, Events: []Event{
		{Kind: Stored, Hashes: []uint64{1, 2}, Tokens: []uint32{1, 2, 3, 4}, BlockSize: 2},
		{Kind: Removed, Hashes: []uint64{1}},
		{Kind: Cleared},
	}}
	for _, form := range []Form{ArrayForm, MapForm} {
		for _, h := range []HashForm{HashUint, HashInt, HashBytes} {
			p, _ := Encode(&in, form, h)
			f.Add(p)
		}
	}
	f.Add([]byte{0x93, 0xdd, 0xff, 0xff, 0xff, 0xff})
	dec := NewDecoder()
	f.Fuzz(func(t *testing.T, p []byte) {
		var b Batch
		if err := dec.Decode(p, &b); err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatalf("error not ErrMalformed: %v", err)
		}
		for _, e := range b.Events {
			if e.Kind > Cleared {
				t.Fatalf("kind %d", e.Kind)
			}
		}
	})
}
