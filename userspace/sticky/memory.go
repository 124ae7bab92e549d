package sticky

import "sync"

// memShards splits the in-process table to keep lock hold times and
// contention low; each shard is an exact LRU of MaxEntries/memShards.
const memShards = 16

// Memory is the in-process table, used when BPF is off: an LRU with the
// semantics of the BPF map (a lookup counts as a use), visible to this
// process only.
type Memory struct {
	shards [memShards]memShard
}

type memShard struct {
	mu   sync.Mutex
	m    map[uint64]*memNode
	head memNode // sentinel: head.next is the most recently used
	cap  int
	_    [40]byte // keep shards on separate cache lines
}

type memNode struct {
	key        uint64
	e          Entry
	prev, next *memNode
}

var _ Table = (*Memory)(nil)

// NewMemory returns an empty in-process table holding at most capacity
// entries (MaxEntries if capacity <= 0).
func NewMemory(capacity int) *Memory {
	if capacity <= 0 {
		capacity = MaxEntries
	}
	t := &Memory{}
	per := (capacity + memShards - 1) / memShards
	for i := range t.shards {
		s := &t.shards[i]
		s.m = make(map[uint64]*memNode)
		s.head.next, s.head.prev = &s.head, &s.head
		s.cap = per
	}
	return t
}

func (t *Memory) shard(key uint64) *memShard {
	// Keys are well mixed hashes; the top bits pick the shard.
	return &t.shards[key>>60&(memShards-1)]
}

func (s *memShard) unlink(n *memNode) {
	n.prev.next, n.next.prev = n.next, n.prev
}

func (s *memShard) pushFront(n *memNode) {
	n.prev, n.next = &s.head, s.head.next
	s.head.next.prev = n
	s.head.next = n
}

// add stores a new key, evicting the least recently used entry when full.
func (s *memShard) add(key uint64, e Entry) {
	if len(s.m) >= s.cap {
		old := s.head.prev
		s.unlink(old)
		delete(s.m, old.key)
	}
	n := &memNode{key: key, e: e}
	s.m[key] = n
	s.pushFront(n)
}

// Lookup implements Table.
func (t *Memory) Lookup(key uint64) (Entry, bool) {
	s := t.shard(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	n, ok := s.m[key]
	if !ok {
		return Entry{}, false
	}
	s.unlink(n)
	s.pushFront(n)
	return n.e, true
}

// Insert implements Table.
func (t *Memory) Insert(key uint64, e Entry) (Entry, bool) {
	s := t.shard(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	if n, ok := s.m[key]; ok {
		return n.e, false
	}
	s.add(key, e)
	return e, true
}

// Put implements Table.
func (t *Memory) Put(key uint64, e Entry) {
	s := t.shard(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	if n, ok := s.m[key]; ok {
		n.e = e
		s.unlink(n)
		s.pushFront(n)
		return
	}
	s.add(key, e)
}

// Delete implements Table.
func (t *Memory) Delete(key uint64) bool {
	s := t.shard(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	n, ok := s.m[key]
	if !ok {
		return false
	}
	s.unlink(n)
	delete(s.m, key)
	return true
}

// Len returns the number of entries, expired ones included.
func (t *Memory) Len() int {
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		n += len(s.m)
		s.mu.Unlock()
	}
	return n
}

// Errors implements Table: always 0, memory operations do not fail.
func (t *Memory) Errors() uint64 { return 0 }

// Shared implements Table: false.
func (t *Memory) Shared() bool { return false }
