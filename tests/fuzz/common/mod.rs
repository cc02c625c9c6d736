//! Shared pieces of the fuzz targets: fuzzer-chosen annotations seeded with
//! the record's real keys, the fixed clock, and the "known finding" switch.
#![allow(dead_code)]

use std::collections::BTreeMap;

use arbitrary::Arbitrary;
use volume_gate::record::{Keys, MAX_INVENTORY_BYTES};

pub const PREFIX: &str = "volumes.cozystack.io/";
pub const WORKER: &str = "system:serviceaccount:volume-gate:volume-gate-worker";

/// The clock every decision uses: 2026-01-01T00:00:00Z plus a fuzzer offset.
pub fn now(offset_secs: i32) -> jiff::Timestamp {
    jiff::Timestamp::from_second(1_767_225_600 + i64::from(offset_secs)).expect("in range")
}

/// Invariant checks that found something already reported in
/// `docs/fuzzing.md` are skipped unless `VG_FUZZ_KNOWN` names them
/// (`VG_FUZZ_KNOWN=F3`, `VG_FUZZ_KNOWN=F1,F5`, or `1` for all), so a run
/// keeps looking for new findings instead of stopping at a known one.
pub fn check_known(id: &str) -> bool {
    std::env::var("VG_FUZZ_KNOWN").is_ok_and(|v| v == "1" || v.split(',').any(|x| x.trim() == id))
}

/// An annotation key: mostly the record's real keys, sometimes anything.
#[derive(Debug, Arbitrary, Clone)]
pub enum AnnKey {
    Phase,
    ReleasedAt,
    Message,
    Volumes,
    Override,
    OverrideBy,
    OverrideAt,
    /// The real key with different case or padding: must not count.
    NearMiss(u8),
    Other(String),
}

/// An annotation value: the values that matter, or anything.
#[derive(Debug, Arbitrary, Clone)]
pub enum AnnVal {
    Released,
    Releasing,
    Blocked,
    Overridden,
    /// A stamp time: `now` plus this many seconds, RFC 3339.
    At(i16),
    /// The requester's (or a fixed) username.
    Username,
    Blank,
    Inventory(InvSpec),
    Text(String),
}

impl AnnKey {
    pub fn render(&self, keys: &Keys) -> String {
        match self {
            AnnKey::Phase => keys.phase.clone(),
            AnnKey::ReleasedAt => keys.released_at.clone(),
            AnnKey::Message => keys.message.clone(),
            AnnKey::Volumes => keys.volumes.clone(),
            AnnKey::Override => keys.override_reason.clone(),
            AnnKey::OverrideBy => keys.override_by.clone(),
            AnnKey::OverrideAt => keys.override_at.clone(),
            AnnKey::NearMiss(n) => {
                let base = match n % 3 {
                    0 => &keys.phase,
                    1 => &keys.override_reason,
                    _ => &keys.override_by,
                };
                match n / 3 % 3 {
                    0 => base.to_uppercase(),
                    1 => format!("{base} "),
                    _ => format!(" {base}"),
                }
            }
            AnnKey::Other(s) => s.clone(),
        }
    }
}

impl AnnVal {
    pub fn render(&self, username: &str, now_offset: i32) -> String {
        match self {
            AnnVal::Released => "Released".into(),
            AnnVal::Releasing => "Releasing".into(),
            AnnVal::Blocked => "Blocked".into(),
            AnnVal::Overridden => "Overridden".into(),
            AnnVal::At(d) => now(now_offset.saturating_add(i32::from(*d))).strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
            AnnVal::Username => username.to_string(),
            AnnVal::Blank => " \t".into(),
            AnnVal::Inventory(spec) => spec.build().encode(),
            AnnVal::Text(s) => s.clone(),
        }
    }
}

pub fn annotations(pairs: &[(AnnKey, AnnVal)], keys: &Keys, username: &str, now_offset: i32) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.render(keys), v.render(username, now_offset))).collect()
}

/// A string that is sometimes huge: `len` copies of `unit` (bounded).
#[derive(Debug, Arbitrary, Clone)]
pub enum BigString {
    Plain(String),
    Repeat { unit: char, len: u32 },
}

impl BigString {
    pub fn build(&self) -> String {
        match self {
            BigString::Plain(s) => s.clone(),
            // Up to a little over two inventory bounds when the top bit of
            // `len` is set, else short (huge strings everywhere are slow).
            BigString::Repeat { unit, len } => {
                let n = if len & 0x8000_0000 != 0 {
                    (*len as usize & 0x7fff_ffff) % (2 * MAX_INVENTORY_BYTES + 4096)
                } else {
                    (*len as usize) % 512
                };
                std::iter::repeat_n(*unit, n / unit.len_utf8().max(1)).collect()
            }
        }
    }
}

/// One volume: small fields, any of which may be huge.
#[derive(Debug, Arbitrary, Clone)]
pub struct VolSpec {
    pub pv: BigString,
    pub driver: Option<String>,
    pub handle: Option<BigString>,
    pub capacity: Option<String>,
    pub reclaim: String,
    pub claim: Option<String>,
    pub gone: bool,
}

impl VolSpec {
    pub fn build(&self, i: usize) -> volume_gate::record::Volume {
        let mut pv = self.pv.build();
        if i > 0 {
            pv.push_str(&format!("-{i}"));
        }
        volume_gate::record::Volume {
            pv,
            driver: self.driver.clone(),
            handle: self.handle.as_ref().map(BigString::build),
            capacity: self.capacity.clone(),
            reclaim: self.reclaim.clone(),
            claim: self.claim.clone(),
            gone: self.gone,
            infra: None,
        }
    }
}

/// The generated part of an inventory stays under this (see InvSpec::build).
pub const MAX_FUZZ_INVENTORY_BYTES: usize = 512 * 1024;

/// An inventory: a few explicit volumes, then `repeat` generated copies of a
/// template (up to 8,000: well past the bound with ordinary entries).
#[derive(Debug, Arbitrary, Clone)]
pub struct InvSpec {
    pub taken_at: BigString,
    pub volumes: Vec<VolSpec>,
    pub template: Option<VolSpec>,
    pub repeat: u16,
    pub gone_every: u8,
    /// Built with `Inventory::new` (consistent counts) or raw counts as a
    /// decoded annotation could carry.
    pub raw_counts: Option<(u64, u64, bool)>,
}

impl InvSpec {
    pub fn build(&self) -> volume_gate::record::Inventory {
        let mut vols: Vec<_> = self.volumes.iter().enumerate().map(|(i, v)| v.build(i)).collect();
        if !check_known("F6") {
            let mut total = 0;
            vols.retain(|v| {
                total += v.pv.len() + v.handle.as_ref().map_or(0, String::len) + 64;
                total <= MAX_FUZZ_INVENTORY_BYTES
            });
        }
        if let Some(t) = &self.template {
            let mut n = usize::from(self.repeat) % 8001;
            // Keep the generated inventory under 512 KiB (five bounds) unless VG_FUZZ_KNOWN=1:
            // past that, encode() is slow in proportion (finding F6) and the
            // run would only report timeouts.
            // With many small entries just over the bound, encode()'s grow
            // loop re-serialises the listing once per added volume (F6): at
            // most 400 generated volumes keeps a run at useful speed.
            if !check_known("F6") {
                let one = serde_json::to_string(&t.build(1)).map_or(1, |j| j.len().max(1));
                n = n.min(MAX_FUZZ_INVENTORY_BYTES / one).min(400);
            }
            for i in 0..n {
                let mut v = t.build(i + 1);
                if self.gone_every > 0 {
                    v.gone = i % usize::from(self.gone_every) == 0;
                }
                vols.push(v);
            }
        }
        let mut inv = volume_gate::record::Inventory::new(self.taken_at.build(), vols);
        if let Some((total, freed, truncated)) = self.raw_counts {
            inv.total = total as usize;
            inv.freed = freed as usize;
            inv.truncated = truncated;
        }
        inv
    }
}

/// True when `needle` (at least `n` bytes) occurs anywhere in `hay`.
pub fn contains_window(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// The first window of `n` bytes of `msg` that also occurs in `input`.
pub fn echoed_window<'a>(msg: &'a [u8], input: &[u8], n: usize) -> Option<&'a [u8]> {
    if msg.len() < n || input.len() < n {
        return None;
    }
    msg.windows(n).find(|w| contains_window(input, w))
}

/// Hex for reports.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
