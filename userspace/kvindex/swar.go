package kvindex

import (
	"encoding/binary"
	"math/bits"
)

// Token ids are read eight bytes at a time (SWAR: SIMD within a
// register): which leading bytes are digits, and their value, in a few
// shifts and three multiplications, instead of a branch and a
// multiply-add per byte. An id of 8 or more digits (none below 10^7,
// far past any vocabulary) goes byte by byte.

const (
	lowNibbles  = 0x0F0F0F0F0F0F0F0F
	highNibbles = 0xF0F0F0F0F0F0F0F0
	ascii0s     = 0x3030303030303030
)

func le64(b []byte) uint64 { return binary.LittleEndian.Uint64(b) }

// leadingDigits returns how many of w's bytes, from the lowest (the
// first in memory), are ASCII digits before the first that is not (8:
// all are), and the number they spell (0 when none are).
func leadingDigits(w uint64) (int, uint64) {
	n := digitRun(w)
	return n, digitsValue(w, n)
}

// digitRun is leadingDigits' count. Branch-free, inlined.
func digitRun(w uint64) int {
	// A byte is a digit when its high nibble is 3 and its low one under
	// 10 (+6 carries into bit 4 from 10 up): bad is nonzero in each
	// other byte. No carry crosses a byte.
	bad := (w&highNibbles ^ ascii0s) | (w&lowNibbles+0x0606060606060606)&0x1010101010101010
	// The high bit of each nonzero byte of bad; 8 when there is none.
	nz := ((bad&0x7F7F7F7F7F7F7F7F + 0x7F7F7F7F7F7F7F7F) | bad) & 0x8080808080808080
	return bits.TrailingZeros64(nz) >> 3
}

// digitsValue is the number w's n leading digit bytes spell (n 0: 0).
// Inlined.
func digitsValue(w uint64, n int) uint64 {
	// The n digits to the top bytes, zeros below them (the leading
	// zeros of an eight-digit number whose first digit is the lowest
	// byte); then pairs, quads and the eight combined. n 0 shifts by
	// 64: 0.
	x := (w & lowNibbles) << (64 - 8*uint(n))
	x = x * (10<<8 + 1) >> 8
	x = (x & 0x00FF00FF00FF00FF) * (100<<16 + 1) >> 16
	return (x & 0x0000FFFF0000FFFF) * (10000<<32 + 1) >> 32
}
