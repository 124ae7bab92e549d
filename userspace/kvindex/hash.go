package kvindex

import "math/bits"

// tether's own block hash. The engines' hashes cannot be recomputed outside
// them (vLLM hashes Python pickles and sends 64 bits of a 256-bit chain),
// so the index keys a block by a chain over token ids: chain(block k) =
// blockHash(chain(block k-1), tokens of block k), from rootChain. The
// namespace (model, LoRA adapter) is mixed in at the end (key), so that a
// body's blocks can be hashed before its adapter field is read.

const (
	rootChain = 0x9e3779b97f4a7c15
	m1        = 0xa0761d6478bd642f
	m2        = 0xe7037ed1a0b428db
	m3        = 0x8ebc6af09c88c6e3
	m4        = 0x589965cc75374cc3
)

// blockHash extends the chain prev by one block of tokens: four
// independent multiply lanes over pairs of tokens, folded and mixed.
func blockHash(prev uint64, t []uint32) uint64 {
	a, b, c, d := prev^m1, prev^m2, prev^m3, prev^m4
	i := 0
	for ; i+8 <= len(t); i += 8 {
		a = bits.RotateLeft64((a^(uint64(t[i])|uint64(t[i+1])<<32))*m1, 31)
		b = bits.RotateLeft64((b^(uint64(t[i+2])|uint64(t[i+3])<<32))*m2, 29)
		c = bits.RotateLeft64((c^(uint64(t[i+4])|uint64(t[i+5])<<32))*m3, 27)
		d = bits.RotateLeft64((d^(uint64(t[i+6])|uint64(t[i+7])<<32))*m4, 25)
	}
	for ; i < len(t); i++ {
		a = bits.RotateLeft64((a^uint64(t[i]))*m1, 31)
	}
	h := a ^ bits.RotateLeft64(b, 17) ^ bits.RotateLeft64(c, 34) ^ bits.RotateLeft64(d, 51) ^ uint64(len(t))
	return fmix(h)
}

func fmix(h uint64) uint64 {
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return h
}

// Salt returns the namespace salt of a model or LoRA adapter name ("" is
// the base model: salt 0).
func Salt(ns string) uint64 {
	if ns == "" {
		return 0
	}
	h := uint64(rootChain)
	for i := 0; i < len(ns); i++ {
		h = (h ^ uint64(ns[i])) * 0x100000001b3
	}
	return fmix(h) | 1
}

func saltBytes(ns []byte) uint64 {
	if len(ns) == 0 {
		return 0
	}
	h := uint64(rootChain)
	for _, c := range ns {
		h = (h ^ uint64(c)) * 0x100000001b3
	}
	return fmix(h) | 1
}

// key is the index key of a chain value in a namespace (never 0: 0 marks
// an empty table slot).
func key(chain, salt uint64) uint64 {
	k := chain ^ salt
	if k == 0 {
		k = 1
	}
	return k
}
