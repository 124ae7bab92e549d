package kvindex

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/tether-rl/tether/userspace/kvevents"
)

// TestLeadingDigits checks the eight-byte reading against strconv: ids of
// 1 to 7 digits followed by every kind of byte, and the 8-digit case.
func TestLeadingDigits(t *testing.T) {
	word := func(s string) uint64 {
		var b [8]byte
		copy(b[:], s)
		return le64(b[:])
	}
	for _, tc := range []struct {
		in   string
		n    int
		want uint64
	}{
		{"1,234567", 1, 1}, {"0]", 1, 0}, {"42 ", 2, 42}, {"1234567,", 7, 1234567},
		{"9999999]", 7, 9999999}, {"0012,", 4, 12}, {"12345678", 8, 0}, {"31999/aa", 5, 31999},
		{"5:", 1, 5}, {"7\x00", 1, 7}, {",123", 0, 0}, {"1\xb9", 1, 1}, {"8\x3a", 1, 8},
	} {
		if n, v := leadingDigits(word(tc.in)); n != tc.n || (n < 8 && v != tc.want) {
			t.Errorf("%q: %d digits, %d; want %d, %d", tc.in, n, v, tc.n, tc.want)
		}
	}
	rng := rand.New(rand.NewPCG(31, 32))
	for i := 0; i < 200000; i++ {
		n := 1 + rng.IntN(7)
		digits := make([]byte, n)
		for j := range digits {
			digits[j] = byte('0' + rng.IntN(10))
		}
		var b [8]byte
		copy(b[:], digits)
		for j := n; j < 8; j++ {
			b[j] = byte(rng.IntN(256))
		}
		if b[n]-'0' < 10 {
			b[n] = ','
		}
		want, _ := strconv.ParseUint(string(digits), 10, 64)
		if gn, gv := leadingDigits(le64(b[:])); gn != n || gv != want {
			t.Fatalf("%q: %d digits, %d; want %d, %d", b[:], gn, gv, n, want)
		}
	}
}

// TestScanSWARSameMatch: Scan reads the same match with the eight-byte
// path as byte by byte, on bodies of ids of every length (1 to 11
// digits, past 2^32), separators and whitespace, lists ending anywhere.
func TestScanSWARSameMatch(t *testing.T) {
	rng := rand.New(rand.NewPCG(33, 34))
	a := toks(rng, 16*64)
	x := New(Config{})
	e0, _ := x.Register("e0")
	x.Apply(e0, []kvevents.Event{*newEngineSim(16, 1).store(a)})
	seps := []string{",", ", ", ",\n  ", " ,", "\t,\r\n"}
	for i := 0; i < 3000; i++ {
		var b bytes.Buffer
		b.WriteString(`{"input_ids":[`)
		n := rng.IntN(len(a) + 40)
		sep := seps[rng.IntN(len(seps))]
		for j := 0; j < n; j++ {
			if j > 0 {
				b.WriteString(sep)
			}
			switch {
			case j < len(a) && rng.IntN(4) > 0:
				fmt.Fprint(&b, a[j]) // the held prompt, to keep the scan going
			case rng.IntN(50) == 0:
				fmt.Fprint(&b, rng.Uint64N(1<<36)) // up to 11 digits, some past 2^32
			default:
				fmt.Fprint(&b, rng.Uint64N(uint64(1)<<(1+rng.IntN(26))))
			}
		}
		if rng.IntN(3) > 0 {
			b.WriteString(`],"sampling_params":{"max_new_tokens":8}}`)
		}
		body := b.Bytes()
		if rng.IntN(4) == 0 {
			body = body[:rng.IntN(len(body)+1)]
		}
		compareSWAR(t, x, body)
	}
}

func compareSWAR(t *testing.T, x *Index, body []byte) {
	t.Helper()
	var fast, slow Match
	okFast := x.scan(body, int64(len(body)), &fast, true)
	okSlow := x.scan(body, int64(len(body)), &slow, false)
	if okFast != okSlow || fast != slow {
		t.Fatalf("body %.200q…: eight-byte %v %+v, byte by byte %v %+v", body, okFast, fast, okSlow, slow)
	}
}

// FuzzScanSWAR: the eight-byte path and the byte-by-byte one agree on any
// body (differential).
func FuzzScanSWAR(f *testing.F) {
	rng := rand.New(rand.NewPCG(35, 36))
	a := toks(rng, 64)
	x := New(Config{})
	e0, _ := x.Register("e0")
	x.Apply(e0, []kvevents.Event{*newEngineSim(16, 1).store(a)})
	f.Add(body(a, ""))
	f.Add([]byte(`{"input_ids":[1,22,333,4444,55555,666666,7777777,88888888,999999999,1000000000,4294967296]}`))
	f.Add([]byte(`{"prompt":[12 ,3,` + "\n" + `45]`))
	f.Fuzz(func(t *testing.T, b []byte) {
		compareSWAR(t, x, b)
	})
}
