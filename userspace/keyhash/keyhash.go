// Package keyhash is tether's fixed 64-bit hash of routing keys, session
// ids, prompts, ring points and worker URLs: FNV-1a 64 followed by the
// MurmurHash3 finalizer (Mix), so that short, similar inputs
// ("http://10.0.0.5:30001#17") still spread over the whole range. It has
// no per-process seed (unlike hash/maphash): every tetherd process on
// every host, before and after an upgrade, hashes a key the same way, and
// the sticky entries of the pinned BPF map stay valid.
package keyhash

// FNV-1a 64 parameters.
const (
	Offset = 14695981039346656037
	prime  = 1099511628211
)

// FNV1a folds b into the FNV-1a state h (start from Offset).
func FNV1a(h uint64, b []byte) uint64 {
	for _, c := range b {
		h ^= uint64(c)
		h *= prime
	}
	return h
}

// FNV1aString is FNV1a of a string.
func FNV1aString(h uint64, s string) uint64 {
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= prime
	}
	return h
}

// Mix is the MurmurHash3 finalizer (fmix64).
func Mix(h uint64) uint64 {
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return h
}

// Sum is the hash of b: Mix(FNV1a(Offset, b)).
func Sum(b []byte) uint64 { return Mix(FNV1a(Offset, b)) }

// String is Sum of a string.
func String(s string) uint64 { return Mix(FNV1aString(Offset, s)) }
