package proxy

// Buffers, pooled, held only while a connection is in a request (a
// connection idle with nothing buffered returns its buffer): the 16 KiB
// client and upstream buffers, and larger ones, powers of two from 32 KiB
// to 64 MiB, pooled by size class: a chunked request body streamed
// (getBigBuf), a head past 16 KiB (roomFor), a body read further for the
// router before it decides (peek.go). Every one is counted in
// Counters.Buffers, the large ones' bytes in Counters.LargeBytes.

import (
	"math/bits"
	"sync"
	"unsafe"
)

const bufSize = 16 << 10

var bufPool = sync.Pool{New: func() any { return new([bufSize]byte) }}

// getBuf takes a buffer, counted in the server's Counters.Buffers.
func (s *Server) getBuf() []byte {
	s.counters.Buffers.Add(1)
	return bufPool.Get().(*[bufSize]byte)[:]
}

// bigBufSize: the buffer of a chunked request body streamed past its head
// (conn.relayRequestBody): a read takes a few chunks at once, where 16 KiB
// took a chunk in two.
const bigBufSize = 128 << 10

// getBigBuf takes a big buffer, counted as one in Counters.Buffers.
func (s *Server) getBigBuf() []byte { return s.getLarge(bigBufSize) }

// The large buffers' size classes: 1<<minLargeShift to 1<<maxLargeShift
// bytes. Each class's pool keeps a pointer to its buffers' first byte (a
// pointer in an interface is no allocation; the class gives the length
// back).
const (
	minLargeShift = 15
	maxLargeShift = 26
	maxLarge      = 1 << maxLargeShift
)

var largePools [maxLargeShift - minLargeShift + 1]sync.Pool

// largeClass is the smallest class that holds n bytes (n <= maxLarge).
func largeClass(n int) int {
	if n <= 1<<minLargeShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minLargeShift
}

// getLarge takes a buffer of at least n bytes (n <= maxLarge), its length
// its class's size.
func (s *Server) getLarge(n int) []byte {
	k := largeClass(n)
	size := 1 << (k + minLargeShift)
	var b []byte
	if p, _ := largePools[k].Get().(*byte); p != nil {
		b = unsafe.Slice(p, size)
	} else {
		b = make([]byte, size)
	}
	s.counters.Buffers.Add(1)
	s.counters.LargeBytes.Add(int64(size))
	return b
}

// putBuf returns a buffer from getBuf, getBigBuf or getLarge, whatever
// its length (others are left to the GC).
func (s *Server) putBuf(b []byte) {
	c := cap(b)
	switch {
	case c == bufSize:
		s.counters.Buffers.Add(-1)
		bufPool.Put((*[bufSize]byte)(b[:bufSize]))
	case c > bufSize && c <= maxLarge && c&(c-1) == 0:
		s.counters.Buffers.Add(-1)
		s.counters.LargeBytes.Add(-int64(c))
		largePools[largeClass(c)].Put(unsafe.SliceData(b[:c]))
	}
}

// roomFor returns b, holding a head not whole yet in its first used
// bytes, with room to read more: when the head fills it, b doubled (a
// head larger than a pooled buffer; the parser's limit ends one too
// long), b given back.
func (s *Server) roomFor(b []byte, used int) []byte {
	if used < len(b) {
		return b
	}
	var nb []byte
	if 2*len(b) <= maxLarge {
		nb = s.getLarge(2 * len(b))
	} else {
		nb = make([]byte, 2*len(b))
	}
	copy(nb, b[:used])
	s.putBuf(b)
	return nb
}
