package route

import (
	"reflect"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/config"
)

// TestSettingsProvision: the settings structs' defaults are the Default*
// constants, a set field is kept, and the constructors provision through
// the same function (what they report is the provisioned settings).
func TestSettingsProvision(t *testing.T) {
	p := DefaultPolicySettings()
	if !reflect.DeepEqual(p, PolicySettings{KeyHeaders: DefaultKeyHeaders, LoadFactor: DefaultLoadFactor, SpillMin: config.Some(DefaultSpillMin), SpillTTL: DefaultSpillTTL, StickyTTL: DefaultStickyTTL}) {
		t.Fatalf("DefaultPolicySettings: %+v", p)
	}
	s := PolicySettings{SpillMin: config.Some(0), StickyTTL: time.Minute}
	s.Provision()
	if s.SpillMin != config.Some(0) || s.StickyTTL != time.Minute || s.LoadFactor != DefaultLoadFactor {
		t.Fatalf("provisioned over settings: %+v", s)
	}
	if l := DefaultLearnSettings(); l != (LearnSettings{CreatePath: DefaultCreatePath, IDField: DefaultIDField, TTL: DefaultLearnTTL, MaxScan: DefaultLearnScan}) {
		t.Fatalf("DefaultLearnSettings: %+v", l)
	}
	if e := DefaultEngineConfig(); e != (EngineConfig{KVVeto: DefaultKVVeto, WaitingVeto: config.Some(DefaultWaitingVeto), GroupMax: config.Some(DefaultGroupMax), MoveMargin: DefaultMoveMargin, MoveSlack: DefaultMoveSlack}) {
		t.Fatalf("DefaultEngineConfig: %+v", e)
	}
	ep, err := NewEnginePlacement(EngineConfig{GroupMax: config.Some(0)})
	if err != nil || ep.Config() != (EngineConfig{KVVeto: DefaultKVVeto, WaitingVeto: config.Some(DefaultWaitingVeto), GroupMax: config.Some(0), MoveMargin: DefaultMoveMargin, MoveSlack: DefaultMoveSlack}) {
		t.Fatalf("NewEnginePlacement: %+v %v", ep, err)
	}
	pol, err := NewPolicy(PolicyConfig{})
	if err != nil || !reflect.DeepEqual(pol.Config().PolicySettings, DefaultPolicySettings()) {
		t.Fatalf("NewPolicy: %+v %v", pol.Config().PolicySettings, err)
	}
}
