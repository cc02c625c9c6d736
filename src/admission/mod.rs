//! The admission gate: decisions as pure functions ([`decide`]), the facts
//! they need read fresh from the API server ([`gate`]), the AdmissionReview
//! wire format ([`review`]) and the HTTP layer ([`server`]).

pub mod decide;
pub mod gate;
pub mod review;
pub mod server;

pub use gate::Gate;
pub use server::router;
