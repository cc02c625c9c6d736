//! Target 2: the release record (src/record.rs).
//!
//! Invariants, on every input:
//! - `Record::from_annotations` on any annotation map (the real keys are
//!   favoured): `is_done()` holds exactly when `phase` is `Released` or an
//!   override with a non-blank reason is stamped (by non-empty, at present);
//!   a present but unparseable phase or inventory is a problem, never done;
//!   `summary()` never panics and names the phase;
//! - any inventory (huge ones included): `encode()` fits
//!   `MAX_INVENTORY_BYTES` (unless even an empty listing does not: known
//!   finding F3), `decode(encode(inv))` succeeds; when nothing had to be cut
//!   it round-trips exactly; when cut it says `truncated`, keeps `taken_at`,
//!   `total` and `freed`, lists volumes still on storage before gone ones,
//!   as a prefix of that order, and the next volume would not have fit;
//! - `Update::annotations` read back through `from_annotations` gives the
//!   same phase, the one-line message (at most 1,024 bytes) and inventory.

#![no_main]

#[path = "../common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Instant;

use arbitrary::Arbitrary;
use common::{AnnKey, AnnVal, InvSpec};
use libfuzzer_sys::fuzz_target;
use volume_gate::record::{Inventory, Keys, MAX_INVENTORY_BYTES, Phase, Record, Update, Volume, one_line};

static KEYS: LazyLock<Keys> = LazyLock::new(|| Keys::new(common::PREFIX));

#[derive(Debug, Arbitrary)]
struct Input {
    annotations: Vec<(AnnKey, AnnVal)>,
    extra: BTreeMap<String, String>,
    username: String,
    inventory: InvSpec,
    update_phase: Option<u8>,
    update_message: Option<common::BigString>,
}

fuzz_target!(|input: Input| {
    check_record(&input);
    let inv = input.inventory.build();
    let text = check_inventory(&inv);
    check_update(&input, inv, &text);
});

fn check_record(input: &Input) {
    let keys = &*KEYS;
    let mut ann = input.extra.clone();
    ann.extend(common::annotations(&input.annotations, keys, &input.username, 0));
    let r = Record::from_annotations(keys, &ann);

    let phase_released = ann.get(&keys.phase).is_some_and(|p| p == "Released");
    let stamped = ann.get(&keys.override_reason).is_some_and(|reason| {
        !reason.trim().is_empty()
            && ann.get(&keys.override_by).is_some_and(|b| !b.is_empty())
            && ann.contains_key(&keys.override_at)
    });
    assert_eq!(r.is_done(), phase_released || stamped, "is_done for {ann:?}: {r:?}");
    if r.is_done() {
        let o = r.stamped_override();
        assert!(
            r.phase == Some(Phase::Released) || o.is_some_and(|o| !o.reason.trim().is_empty()),
            "done without Released or a stamped, reasoned override: {r:?}"
        );
    }
    if let Some(p) = ann.get(&keys.phase) {
        match p.parse::<Phase>() {
            Ok(ph) => assert_eq!(r.phase, Some(ph)),
            Err(_) => {
                assert_eq!(r.phase, None);
                assert!(!r.problems.is_empty(), "an unknown phase is a problem");
            }
        }
    }
    if let Some(v) = ann.get(&keys.volumes) {
        assert_eq!(r.inventory.is_none(), Inventory::decode(v).is_err());
        if r.inventory.is_none() {
            assert!(!r.problems.is_empty(), "a bad inventory is a problem");
        }
    }
    let s = r.summary();
    let phase = r.phase.map_or("not started", Phase::as_str);
    assert!(s.starts_with(&format!("phase {phase}")), "{s}");
}

fn check_inventory(inv: &Inventory) -> String {
    let started = Instant::now();
    let text = inv.encode();
    let took = started.elapsed();
    let full = serde_json::to_string(inv).unwrap();
    if std::env::var_os("VG_FUZZ_DEBUG").is_some() {
        eprintln!(
            "inventory: {} volumes ({} gone), full JSON {} bytes, encoded {} bytes, encode() took {took:?}",
            inv.volumes.len(),
            inv.volumes.iter().filter(|v| v.gone).count(),
            full.len(),
            text.len()
        );
    }
    // The smallest truncated listing: no volumes at all.
    let floor = serde_json::to_string(&Inventory { truncated: true, volumes: Vec::new(), ..inv.clone() }).unwrap();

    if text.len() > MAX_INVENTORY_BYTES {
        // F3: the bound cannot hold when even an empty listing exceeds it.
        let known_f3 = floor.len() > MAX_INVENTORY_BYTES && !common::check_known("F3");
        assert!(
            known_f3,
            "encode() returned {} bytes > MAX_INVENTORY_BYTES {} (empty listing {} bytes, {} volumes, took {took:?})",
            text.len(),
            MAX_INVENTORY_BYTES,
            floor.len(),
            inv.volumes.len()
        );
    }
    let back = match Inventory::decode(&text) {
        Ok(b) => b,
        Err(e) => panic!("decode(encode(inv)) failed: {e}"),
    };
    if full.len() <= MAX_INVENTORY_BYTES {
        assert_eq!(text, full);
        assert_eq!(&back, inv, "round trip");
        return text;
    }
    assert!(back.truncated, "a cut inventory says so");
    assert_eq!((back.total, back.freed, &back.taken_at), (inv.total, inv.freed, &inv.taken_at));
    let order: Vec<&Volume> = inv.volumes.iter().filter(|v| !v.gone).chain(inv.volumes.iter().filter(|v| v.gone)).collect();
    let k = back.volumes.len();
    assert!(k <= order.len());
    for (i, (a, b)) in back.volumes.iter().zip(&order).enumerate() {
        assert_eq!(a, *b, "listed volume {i} is not the {i}th of remaining-then-gone order");
    }
    if k < order.len() && text.len() <= MAX_INVENTORY_BYTES {
        let mut one_more = back.clone();
        one_more.volumes.push(order[k].clone());
        let longer = serde_json::to_string(&one_more).unwrap();
        assert!(longer.len() > MAX_INVENTORY_BYTES, "volume {k} would have fitted ({} bytes)", longer.len());
    }
    text
}

fn check_update(input: &Input, inv: Inventory, encoded: &str) {
    let keys = &*KEYS;
    let update = Update {
        phase: input.update_phase.map(|p| Phase::ALL[usize::from(p) % 4]),
        message: input.update_message.as_ref().map(common::BigString::build),
        released_at: None,
        inventory: Some(inv),
    };
    let m = update.annotations(keys);
    let ann: BTreeMap<String, String> =
        m.iter().map(|(k, v)| (k.clone(), v.as_str().expect("annotation values are strings").to_string())).collect();
    let r = Record::from_annotations(keys, &ann);
    assert_eq!(r.phase, update.phase);
    if let Some(msg) = &update.message {
        let line = one_line(msg);
        assert!(line.len() <= 1024, "one_line gave {} bytes", line.len());
        assert!(!line.contains('\n'));
        assert_eq!(r.message.as_deref(), Some(line.as_str()));
    }
    assert_eq!(ann.get(&keys.volumes).map(String::as_str), Some(encoded), "encode() is deterministic");
    let back = r.inventory.as_ref().expect("the written inventory reads back");
    assert_eq!(back, &Inventory::decode(encoded).unwrap());
}
