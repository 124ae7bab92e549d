package demo

import (
	"encoding/binary"
	"io"
	"math/rand/v2"
)

// blobPiece is the write size of the blob endpoint and of the echo loop.
const blobPiece = 64 << 10

// Blob returns a reader of exactly size deterministic pseudo-random bytes: the
// ChaCha8 stream (math/rand/v2) keyed by seed in little-endian order in the
// first 8 of the 32 key bytes, the rest zero. GET /sessions/{id}/blob?size=N&seed=S
// serves exactly Blob(N, S), so a test can compute the expected digest itself.
// The stream does not depend on how the reads are sized.
func Blob(size int64, seed uint64) io.Reader {
	if size < 0 {
		size = 0
	}
	return &blobReader{rng: newBlobRNG(seed), left: size}
}

func newBlobRNG(seed uint64) *rand.ChaCha8 {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:8], seed)
	return rand.NewChaCha8(key)
}

type blobReader struct {
	rng  *rand.ChaCha8
	left int64
}

func (b *blobReader) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, _ := b.rng.Read(p) // never fails
	b.left -= int64(n)
	return n, nil
}
