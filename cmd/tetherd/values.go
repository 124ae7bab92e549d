package main

import (
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// positive is a flag whose zero would otherwise silently stand for its
// default (the components take a zero setting as "the default"): it
// refuses 0 and negative values, naming the flag, so the default the help
// shows is the only one. orNone also accepts -1, the flag's "none".
type positive[T int | int64 | float64 | time.Duration] struct {
	name   string
	p      *T
	orNone bool
}

// positiveVar registers a positive flag writing into p, starting at def;
// the help says what it accepts.
func positiveVar[T int | int64 | float64 | time.Duration](fs *flag.FlagSet, p *T, name string, def T, usage string) {
	*p = def
	fs.Var(&positive[T]{name: name, p: p}, name, usage+" (> 0)")
}

// positiveOrNoneVar is positiveVar that also takes -1; usage says what -1
// means.
func positiveOrNoneVar[T int | int64](fs *flag.FlagSet, p *T, name string, def T, usage string) {
	*p = def
	fs.Var(&positive[T]{name: name, p: p, orNone: true}, name, usage)
}

func (v *positive[T]) String() string {
	if v.p == nil {
		return ""
	}
	switch x := any(*v.p).(type) {
	case time.Duration:
		return x.String()
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64)
	}
	return fmt.Sprint(*v.p)
}

func (v *positive[T]) Set(s string) error {
	s = strings.TrimSpace(s)
	var n T
	var err error
	switch p := any(&n).(type) {
	case *time.Duration:
		*p, err = time.ParseDuration(s)
	case *float64:
		*p, err = strconv.ParseFloat(s, 64)
	case *int:
		*p, err = strconv.Atoi(s)
	case *int64:
		*p, err = strconv.ParseInt(s, 10, 64)
	}
	want := "a value > 0"
	if _, ok := any(n).(time.Duration); ok {
		want = "a duration > 0"
	}
	if v.orNone {
		want += ", or -1"
	}
	if err != nil || n <= 0 && !(v.orNone && n == -1) {
		return fmt.Errorf("--%s %q: want %s", v.name, s, want)
	}
	*v.p = n
	return nil
}
