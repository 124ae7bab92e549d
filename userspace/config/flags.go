package config

import (
	"flag"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"
)

// A component declares each of its settings once, as a Setting: the flag
// name, the help text, the field it writes, the default and the range.
// The same list registers the flags (Register, from the component's
// RegisterFlags: the flag writes the field directly, starting at the
// default) and checks the fields (Validate, from the component's
// Validate: a field set in code is held to the flag's range, and the
// error names the flag). A field's zero value, or an unset Optional, is
// the component's default (its Provision).

// Optional is a setting that may be unset: its zero value is unset, and
// the component then applies its default. Some(v) is set to v (where v
// may be a value that means "none", e.g. 0: no bound).
type Optional[T any] struct {
	v   T
	set bool
}

// Some returns an Optional set to v.
func Some[T any](v T) Optional[T] { return Optional[T]{v: v, set: true} }

// Get returns the value and whether it is set.
func (o Optional[T]) Get() (T, bool) { return o.v, o.set }

// Or returns the value if set, else def.
func (o Optional[T]) Or(def T) T {
	if o.set {
		return o.v
	}
	return def
}

// IsSet says whether the value is set.
func (o Optional[T]) IsSet() bool { return o.set }

// String is the value, or "unset".
func (o Optional[T]) String() string {
	if !o.set {
		return "unset"
	}
	return fmt.Sprint(o.v)
}

// Range is what a numeric setting accepts.
type Range int

const (
	Any            Range = iota // every value
	NonNegative                 // >= 0 (0 means something, e.g. no limit)
	Positive                    // > 0 (the field's 0 is unset: the default)
	PositiveOrNone              // > 0, or -1: none
)

// Setting is one flag of a component's settings.
type Setting struct {
	Name  string
	Usage string
	v     value
}

// value is the flag.Value of a Setting.
type value interface {
	flag.Value
	init()            // writes the default into the field
	check() error     // nil: the field is in range (unset included)
	typeName() string // the placeholder -h prints after the name ("" for a boolean)
	zero() string     // the String of a flag at its zero: -h prints the default when it differs
	quoted() bool     // -h quotes the default
}

// HideDefault keeps -h from printing the setting's default (one that
// depends on the machine, which the usage describes in words).
func (s Setting) HideDefault() Setting {
	s.v = hidden{s.v}
	return s
}

type hidden struct{ value }

func (h hidden) zero() string { return "\x00hidden" }

// Type sets the placeholder -h prints after the flag's name ("value"
// unless said: the standard library's names, "duration", "int", where
// the help always said so).
func (s Setting) Type(name string) Setting {
	switch v := s.v.(type) {
	case *numValue[int]:
		v.typ = name
	case *numValue[int64]:
		v.typ = name
	case *numValue[uint64]:
		v.typ = name
	case *numValue[float64]:
		v.typ = name
	case *numValue[time.Duration]:
		v.typ = name
	case *optValue[int]:
		v.typ = name
	case *optValue[time.Duration]:
		v.typ = name
	}
	return s
}

// Register registers every setting as a flag of fs, writing its field,
// which starts at the default.
func Register(fs *flag.FlagSet, settings []Setting) {
	for _, s := range settings {
		s.v.init()
		fs.Var(s.v, s.Name, s.Usage)
	}
}

// Validate checks every setting's field against its flag's range; the
// error names the flag.
func Validate(settings []Setting) error {
	for _, s := range settings {
		if err := s.v.check(); err != nil {
			return err
		}
	}
	return nil
}

// Number is a numeric setting's type.
type Number interface {
	~int | ~int64 | ~uint64 | ~float64
}

// Num declares a numeric setting (int, int64, uint64, float64,
// time.Duration) in range r.
func Num[T Number](p *T, name string, def T, r Range, usage string) Setting {
	return Setting{Name: name, Usage: usage, v: &numValue[T]{numeric: numeric[T]{name: name, def: def, r: r}, p: p, typ: "value"}}
}

// Opt declares an optional numeric setting in range r: the flag sets it,
// and it starts set to def.
func Opt[T Number](p *Optional[T], name string, def T, r Range, usage string) Setting {
	return Setting{Name: name, Usage: usage, v: &optValue[T]{numeric: numeric[T]{name: name, def: def, r: r}, p: p, typ: "value"}}
}

// numeric holds what a numeric flag's value and range checks share.
type numeric[T Number] struct {
	name string
	def  T
	r    Range
}

func isDuration[T Number]() bool {
	_, ok := any(T(0)).(time.Duration)
	return ok
}

func format[T Number](v T) string {
	switch x := any(v).(type) {
	case time.Duration:
		return x.String()
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64)
	}
	return fmt.Sprint(v)
}

func (n numeric[T]) want() string {
	kind := "a value"
	if isDuration[T]() {
		kind = "a duration"
	}
	switch n.r {
	case NonNegative:
		return kind + " >= 0"
	case Positive:
		return kind + " > 0"
	case PositiveOrNone:
		return kind + " > 0, or -1"
	}
	return kind
}

// parse reads s, refusing what the flag refuses.
func (n numeric[T]) parse(s string) (T, error) {
	s = strings.TrimSpace(s)
	var v T
	var err error
	switch p := any(&v).(type) {
	case *time.Duration:
		*p, err = time.ParseDuration(s)
	case *float64:
		*p, err = strconv.ParseFloat(s, 64)
	case *int:
		*p, err = strconv.Atoi(s)
	case *int64:
		*p, err = strconv.ParseInt(s, 10, 64)
	case *uint64:
		*p, err = strconv.ParseUint(s, 10, 64)
	}
	if err != nil || !n.in(v, false) {
		return 0, fmt.Errorf("--%s %q: want %s", n.name, s, n.want())
	}
	return v, nil
}

// in says whether v is in range; unset: v is a field's zero, the default.
func (n numeric[T]) in(v T, unset bool) bool {
	switch n.r {
	case NonNegative:
		return v >= 0
	case Positive:
		return v > 0 || unset && v == 0
	case PositiveOrNone:
		return v > 0 || v == 0 && unset || isMinusOne(v)
	}
	return true
}

func isMinusOne[T Number](v T) bool {
	switch x := any(v).(type) {
	case int:
		return x == -1
	case int64:
		return x == -1
	case float64:
		return x == -1
	}
	return false
}

func (n numeric[T]) checkField(v T, set bool) error {
	if !n.in(v, !set) {
		if v < 0 {
			return fmt.Errorf("--%s: negative; want %s", n.name, n.want())
		}
		return fmt.Errorf("--%s %s: want %s", n.name, format(v), n.want())
	}
	return nil
}

type numValue[T Number] struct {
	numeric[T]
	p   *T
	typ string
}

func (v *numValue[T]) init() { *v.p = v.def }
func (v *numValue[T]) String() string {
	if v == nil || v.p == nil {
		return ""
	}
	return format(*v.p)
}

func (v *numValue[T]) Set(s string) error {
	n, err := v.parse(s)
	if err == nil {
		*v.p = n
	}
	return err
}
func (v *numValue[T]) check() error     { return v.checkField(*v.p, false) }
func (v *numValue[T]) typeName() string { return v.typ }
func (v *numValue[T]) quoted() bool     { return false }
func (v *numValue[T]) zero() string {
	if v.typ == "value" {
		return ""
	}
	return format(T(0)) // a standard library flag's zero
}

type optValue[T Number] struct {
	numeric[T]
	p   *Optional[T]
	typ string
}

func (v *optValue[T]) init() { *v.p = Some(v.def) }
func (v *optValue[T]) String() string {
	if v == nil || v.p == nil || !v.p.set {
		return ""
	}
	return format(v.p.v)
}

func (v *optValue[T]) Set(s string) error {
	n, err := v.parse(s)
	if err == nil {
		*v.p = Some(n)
	}
	return err
}

func (v *optValue[T]) check() error {
	if !v.p.set {
		return nil
	}
	return v.checkField(v.p.v, true)
}
func (v *optValue[T]) typeName() string { return v.typ }
func (v *optValue[T]) quoted() bool     { return false }
func (v *optValue[T]) zero() string {
	if v.typ == "value" {
		return ""
	}
	return format(T(0))
}

// Bool declares a boolean setting.
func Bool(p *bool, name string, def bool, usage string) Setting {
	return Setting{Name: name, Usage: usage, v: &boolValue{name: name, def: def, set: func(b bool) { *p = b }, get: func() bool { return *p }}}
}

// Switch declares an optional boolean setting (unset: the component's
// default, def).
func Switch(p *Optional[bool], name string, def bool, usage string) Setting {
	return Setting{Name: name, Usage: usage, v: &boolValue{name: name, def: def, set: func(b bool) { *p = Some(b) }, get: func() bool { return p.Or(def) }}}
}

// Flag declares a boolean flag whose setting is a string: on when true
// (e.g. the name of a header to add), "" when false.
func Flag(p *string, name, on, usage string) Setting {
	return Setting{Name: name, Usage: usage, v: &boolValue{name: name,
		set: func(b bool) {
			*p = ""
			if b {
				*p = on
			}
		},
		get: func() bool { return *p != "" }}}
}

type boolValue struct {
	name string
	def  bool
	set  func(bool)
	get  func() bool
}

func (v *boolValue) init() { v.set(v.def) }
func (v *boolValue) String() string {
	if v == nil || v.get == nil {
		return "false"
	}
	return strconv.FormatBool(v.get())
}

func (v *boolValue) Set(s string) error {
	b, err := strconv.ParseBool(s)
	if err != nil {
		return fmt.Errorf("--%s %q: want true or false", v.name, s)
	}
	v.set(b)
	return nil
}
func (v *boolValue) IsBoolFlag() bool { return true }
func (v *boolValue) check() error     { return nil }
func (v *boolValue) typeName() string { return "" }
func (v *boolValue) zero() string     { return "false" }
func (v *boolValue) quoted() bool     { return false }

// Str declares a string setting; parse (nil: any string) checks a value
// and may rewrite it ("off" for ""); the field is checked with it too,
// unless empty (unset).
func Str(p *string, name, def, usage string, parse func(string) (string, error)) Setting {
	return Setting{Name: name, Usage: usage, v: &textValue[string]{name: name, p: p, def: def,
		parse:  parse,
		format: func(s string) string { return s }}}
}

// Mode declares a typed mode (a kind, a policy): parse reads a flag
// value, fmt.Sprint (the type's String) writes it.
func Mode[T any](p *T, name string, def T, usage string, parse func(string) (T, error)) Setting {
	return Setting{Name: name, Usage: usage, v: &textValue[T]{name: name, p: p, def: def, parse: parse,
		format: func(v T) string { return fmt.Sprint(v) }}}
}

type textValue[T any] struct {
	name   string
	p      *T
	def    T
	parse  func(string) (T, error)
	format func(T) string
}

func (v *textValue[T]) init() { *v.p = v.def }
func (v *textValue[T]) String() string {
	if v == nil || v.p == nil {
		return ""
	}
	return v.format(*v.p)
}

func (v *textValue[T]) Set(s string) error {
	if v.parse == nil {
		x, ok := any(s).(T)
		if !ok {
			return fmt.Errorf("--%s: no parser", v.name)
		}
		*v.p = x
		return nil
	}
	x, err := v.parse(s)
	if err != nil {
		return err
	}
	*v.p = x
	return nil
}

func (v *textValue[T]) check() error {
	s := v.format(*v.p)
	if v.parse == nil || s == "" {
		return nil
	}
	_, err := v.parse(s)
	return err
}
func (v *textValue[T]) typeName() string { return "string" }
func (v *textValue[T]) zero() string     { return "" }
func (v *textValue[T]) quoted() bool     { return true }

// List declares a repeatable setting of strings: each use adds its
// value, or with comma set its comma-separated values (trimmed, empty
// ones dropped); the first use replaces the default.
func List(p *[]string, name string, def []string, comma bool, usage string) Setting {
	return Setting{Name: name, Usage: usage, v: &listValue{p: p, def: def, comma: comma}}
}

type listValue struct {
	p     *[]string
	def   []string
	comma bool
	used  bool
}

func (v *listValue) init() {
	*v.p = append([]string(nil), v.def...)
	if v.def == nil {
		*v.p = nil
	}
}

func (v *listValue) String() string {
	if v == nil || v.p == nil {
		return ""
	}
	return strings.Join(*v.p, ",")
}

func (v *listValue) Set(s string) error {
	if !v.used {
		*v.p, v.used = nil, true
	}
	if !v.comma {
		*v.p = append(*v.p, s)
		return nil
	}
	for _, e := range strings.Split(s, ",") {
		if e = strings.TrimSpace(e); e != "" {
			*v.p = append(*v.p, e)
		}
	}
	return nil
}
func (v *listValue) check() error     { return nil }
func (v *listValue) typeName() string { return "value" }
func (v *listValue) zero() string     { return strings.Join(v.def, ",") } // the help says the default itself
func (v *listValue) quoted() bool     { return false }

// Usage sets fs's usage message: "Usage of NAME:" and PrintDefaults.
func Usage(fs *flag.FlagSet) {
	fs.Usage = func() {
		if fs.Name() == "" {
			fmt.Fprintf(fs.Output(), "Usage:\n")
		} else {
			fmt.Fprintf(fs.Output(), "Usage of %s:\n", fs.Name())
		}
		PrintDefaults(fs)
	}
}

// PrintDefaults prints fs's flags exactly as flag.FlagSet.PrintDefaults
// does, except that a Setting's flag prints its own placeholder
// (Setting.Type; a mode's "string") and says its default where it has
// one.
func PrintDefaults(fs *flag.FlagSet) {
	fs.VisitAll(func(f *flag.Flag) {
		var b strings.Builder
		fmt.Fprintf(&b, "  -%s", f.Name)
		name, usage := flag.UnquoteUsage(f)
		v, mine := f.Value.(value)
		if mine && !strings.Contains(f.Usage, "`") {
			name = v.typeName()
		}
		if len(name) > 0 {
			b.WriteString(" ")
			b.WriteString(name)
		}
		if b.Len() <= 4 {
			b.WriteString("\t")
		} else {
			b.WriteString("\n    \t")
		}
		b.WriteString(strings.ReplaceAll(usage, "\n", "\n    \t"))
		zero, quote := stdZero(f)
		_, hide := f.Value.(hidden)
		if mine {
			zero, quote = v.zero(), v.quoted()
		}
		if f.DefValue != zero && !hide {
			if quote {
				fmt.Fprintf(&b, " (default %q)", f.DefValue)
			} else {
				fmt.Fprintf(&b, " (default %v)", f.DefValue)
			}
		}
		fmt.Fprint(fs.Output(), b.String(), "\n")
	})
}

// stdZero is what the flag package compares a default with: the String
// of the flag's value type at its zero, and whether it quotes defaults
// (its string flags).
func stdZero(f *flag.Flag) (zero string, quote bool) {
	quote = fmt.Sprintf("%T", f.Value) == "*flag.stringValue"
	typ := reflect.TypeOf(f.Value)
	var z reflect.Value
	if typ.Kind() == reflect.Pointer {
		z = reflect.New(typ.Elem())
	} else {
		z = reflect.Zero(typ)
	}
	defer func() {
		if recover() != nil {
			zero = ""
		}
	}()
	fv, ok := z.Interface().(flag.Value)
	if !ok {
		return "", quote
	}
	return fv.String(), quote
}
