package kvindex

import (
	"math/rand/v2"
	"testing"
)

func BenchmarkHash4096(b *testing.B) {
	t := toks(rand.New(rand.NewPCG(1, 1)), 4096)
	b.ReportAllocs()
	var s uint64
	cpu := threadCPU()
	defer func() { b.ReportMetric(float64(threadCPU()-cpu)/float64(b.N), "cpu-ns/op") }()
	for i := 0; i < b.N; i++ {
		c := uint64(rootChain)
		for j := 0; j < len(t); j += 16 {
			c = blockHash(c, t[j:j+16])
		}
		s += c
	}
	_ = s
}
