package kvindex

// table is an open-addressing hash table from block key to the bit set of
// engines holding the block: linear probing, deletion by backward shift,
// kept at most half full. Keys are already mixed (fmix): the low bits
// index.
type table struct {
	keys  []uint64 // 0: empty
	masks []uint64
	n     int
}

func newTable(size int) table {
	s := 64
	for s < size {
		s <<= 1
	}
	return table{keys: make([]uint64, s), masks: make([]uint64, s)}
}

// get returns k's engine set (0: none).
func (t *table) get(k uint64) uint64 {
	m := uint64(len(t.keys) - 1)
	for i := k & m; ; i = (i + 1) & m {
		switch t.keys[i] {
		case k:
			return t.masks[i]
		case 0:
			return 0
		}
	}
}

// or sets bits in k's engine set, adding k; it reports the set before.
func (t *table) or(k, bits uint64) uint64 {
	if 2*(t.n+1) > len(t.keys) {
		t.grow()
	}
	m := uint64(len(t.keys) - 1)
	for i := k & m; ; i = (i + 1) & m {
		switch t.keys[i] {
		case k:
			old := t.masks[i]
			t.masks[i] |= bits
			return old
		case 0:
			t.keys[i], t.masks[i] = k, bits
			t.n++
			return 0
		}
	}
}

// andNot clears bits in k's engine set, removing k when none is left.
func (t *table) andNot(k, bits uint64) {
	m := uint64(len(t.keys) - 1)
	i := k & m
	for {
		switch t.keys[i] {
		case 0:
			return
		case k:
			t.masks[i] &^= bits
			if t.masks[i] == 0 {
				t.del(i)
			}
			return
		}
		i = (i + 1) & m
	}
}

// del empties slot i and shifts back the entries of its probe run.
func (t *table) del(i uint64) {
	m := uint64(len(t.keys) - 1)
	t.n--
	j := i
	for {
		j = (j + 1) & m
		if t.keys[j] == 0 {
			break
		}
		home := t.keys[j] & m
		// Move j to i when its home is not in the cyclic range (i, j].
		if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
			t.keys[i], t.masks[i] = t.keys[j], t.masks[j]
			i = j
		}
	}
	t.keys[i], t.masks[i] = 0, 0
}

func (t *table) grow() {
	old := *t
	*t = newTable(2 * len(old.keys))
	for i, k := range old.keys {
		if k != 0 {
			t.or(k, old.masks[i])
		}
	}
}

// bytes is the table's memory.
func (t *table) bytes() int { return 16 * len(t.keys) }
