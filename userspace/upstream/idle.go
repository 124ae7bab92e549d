package upstream

// Idle is a worker's idle upstream connections: the one set for every
// holder, a Pool (the goroutine path's connections) and each event loop
// of userspace/proxy (its own sockets). The most recently idle is reused
// first (LIFO: the warmest socket, and the others age out); at the cap
// the oldest is evicted, and the oldest expire first. It does no locking
// and no I/O: the holder closes what it takes out.
type Idle[T comparable] struct {
	list []T // oldest first
}

// Len returns how many are idle.
func (s *Idle[T]) Len() int { return len(s.list) }

// Pop takes the most recently idle one.
func (s *Idle[T]) Pop() (v T, ok bool) {
	n := len(s.list)
	if n == 0 {
		return v, false
	}
	v = s.list[n-1]
	var zero T
	s.list[n-1] = zero
	s.list = s.list[:n-1]
	return v, true
}

// Push keeps v, at most max in all: at the cap the oldest is taken out
// first and returned (evicted), for the holder to close.
func (s *Idle[T]) Push(v T, max int) (evicted T, ok bool) {
	if len(s.list) >= max && len(s.list) > 0 {
		evicted, ok = s.list[0], true
		s.dropOldest()
	}
	s.list = append(s.list, v)
	return evicted, ok
}

// Oldest returns the one idle longest, without taking it.
func (s *Idle[T]) Oldest() (v T, ok bool) {
	if len(s.list) == 0 {
		return v, false
	}
	return s.list[0], true
}

// DropOldest takes out the one idle longest (Oldest).
func (s *Idle[T]) DropOldest() {
	if len(s.list) > 0 {
		s.dropOldest()
	}
}

func (s *Idle[T]) dropOldest() {
	n := copy(s.list, s.list[1:])
	var zero T
	s.list[n] = zero
	s.list = s.list[:n]
}

// Remove takes v out (the worker closed it while idle); false if it was
// not there.
func (s *Idle[T]) Remove(v T) bool {
	for i, w := range s.list {
		if w == v {
			n := copy(s.list[i:], s.list[i+1:])
			var zero T
			s.list[i+n] = zero
			s.list = s.list[:i+n]
			return true
		}
	}
	return false
}

// TakeAll takes out every one, oldest first.
func (s *Idle[T]) TakeAll() []T {
	l := s.list
	s.list = nil
	return l
}
