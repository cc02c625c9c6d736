//! The admission gate: decisions as pure functions ([`decide`]), the
//! AdmissionReview wire format ([`review`]) and the HTTP layer ([`server`]).

pub mod decide;
pub mod review;
pub mod server;
