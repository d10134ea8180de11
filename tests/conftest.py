"""Shared test fixtures. Tests run on CPU with fp32; multi-rank tests use gloo, one thread per rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite is the CPU's (CI has no GPU). On a machine with GPUs they are hidden from the tests
# and from the ranks the tests start, so that `--device auto` means the CPU and gloo everywhere
# (two ranks of a node would otherwise ask for two GPUs). The GPU's own checks are
# bench/gpu_checks.py; TPC_TEST_CUDA=1 leaves the GPUs visible.
if os.environ.get("TPC_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    return ROOT / "examples"


# ------------------------------------------------------------------------------ the fast tier
#
# `pytest -m "not slow"` is the fast tier (a few minutes on 2 cores); the full suite is CI's.
# The tests below are marked slow here, in one place, by node id: a test file, a test function
# (every case of it) or one case. Slow are the multi-process tests (torchrun ranks, bench scripts
# run as programs), the Hugging Face models, long single runs, and the matrices of cases and the
# end-to-end runs whose every module keeps a faster test in the tier (durations measured with
# --durations=0 on the 2-core machine). tests/test_tiers.py checks that each entry still names a
# test. (A module may also mark itself: `pytestmark = pytest.mark.slow`.)
SLOW = (
    "tests/executors/test_documents.py::test_torchrun_gloo_matches_each_document_alone",
    "tests/executors/test_documents.py::test_plan_and_run_must_agree_on_documents",
    "tests/executors/test_documents.py::test_each_document_as_if_alone[hf-llama-1]",
    "tests/compiler/frontend/test_documents_hf.py::test_each_document_as_if_alone",
    "tests/executors/test_chimera_ties.py::test_torchrun_gloo_matches_autograd_and_the_interpreter",
    "tests/executors/test_critical_path_schedules.py::test_torchrun_gloo_matches_autograd_and_the_interpreter",
    "tests/executors/test_tensor_parallel.py::test_torchrun_gloo_matches_autograd_and_the_interpreter",
    "tests/executors/test_tensor_parallel.py::test_compiled_programs_with_a_tensor_axis_match_autograd",
    # slice pairs: nanoGPT and HF GPT-2 stay in the tier, the Llamas are slow
    "tests/executors/test_tensor_parallel.py::test_slice_pairs_overlapping_their_collectives_compute_what_the_plain_plan_computes[llama-tp]",
    "tests/executors/test_tensor_parallel.py::test_slice_pairs_overlapping_their_collectives_compute_what_the_plain_plan_computes[llama-tp-sp]",
    "tests/executors/test_tensor_parallel.py::test_slice_pairs_overlapping_their_collectives_compute_what_the_plain_plan_computes[hf-llama-tp]",
    "tests/executors/test_tensor_parallel.py::test_slice_pairs_overlapping_their_collectives_compute_what_the_plain_plan_computes[hf-llama-tp-sp]",
    "tests/compiler/tensor/test_tensor_exact.py::test_more_hugging_face_families_split_exactly[gemma]",
    "tests/compiler/tensor/test_tensor_exact.py::test_more_hugging_face_families_split_exactly[opt]",
    "tests/compiler/tensor/test_tensor_exact.py::test_more_hugging_face_families_split_exactly[qwen2]",
    "tests/compiler/tensor/test_tensor_exact.py::test_more_hugging_face_families_split_exactly[mistral]",
    "tests/executors/test_compiled_programs.py::test_every_schedule_runs_compiled_and_exact",
    "tests/executors/test_host_sync.py::test_a_compiled_step_reads_the_device_once",
    "tests/executors/test_stage_programs.py::test_hugging_face_decoders_split_as_autograd_does[first-llama]",
    "tests/executors/test_stage_programs.py::test_hugging_face_decoders_split_as_autograd_does[middle-llama]",
    "tests/executors/test_stage_programs.py::test_hugging_face_decoders_split_as_autograd_does[last-llama]",
    "tests/executors/test_compiled_programs.py::test_chimera_runs_compiled_and_exact",
    "tests/executors/test_compiled_programs.py::test_torchrun_compiled_matches_autograd",
    "tests/executors/test_compiled_programs.py::test_a_compiled_profile_times_the_compiled_programs",
    "tests/executors/test_compiled_programs.py::test_the_evaluation_program_runs_compiled_and_gives_the_eager_loss",
    "tests/executors/test_compiled_programs.py::test_recomputation_and_data_parallel_run_compiled_and_exact",
    "tests/executors/test_compiled_programs.py::test_code_nobody_here_wrote_runs_compiled_and_exact",
    # multi-process: ranks under torchrun (gloo), bench scripts run as programs
    "tests/library/test_nanogpt.py",
    "tests/library/test_user_loop.py::test_sgd_onecycle_and_clipping_match_plain_pytorch_under_torchrun",
    "tests/library/test_api.py::test_under_torchrun_the_refusal_names_the_rank_that_trains_the_parameter",
    "tests/library/test_api.py::test_a_plan_file_runs_under_torchrun_with_each_rank_building_only_its_parameters",
    "tests/library/test_library_doc.py::test_the_example_script_runs_and_learns",
    "tests/bench/test_gpu_checks_smoke.py",
    "tests/bench/test_gpu_slicing_smoke.py::test_smoke_run_prints_three_filled_tables",
    "tests/bench/test_gpu_slicing_smoke.py::test_timed_steps_size_kv_as_the_engine_and_copy_no_gradients",
    "tests/executors/test_evaluation.py::test_torchrun_eval_loss_is_the_interpreters_and_plain_pytorch",
    "tests/executors/test_host_sync.py::test_two_gloo_ranks_read_the_device_once_a_step",
    "tests/executors/test_multinode.py",
    "tests/executors/test_ordered_exchanges.py::test_two_gloo_ranks_with_the_rendezvous_wire_match_the_interpreter_and_autograd",
    "tests/executors/training/test_curriculum.py::test_two_gloo_ranks_match_plain_pytorch_and_resume_mid_curriculum",
    "tests/executors/training/test_reshard.py::test_gloo_ranks_resume_under_another_split",
    "tests/executors/training/test_resume.py::test_a_kill_during_a_save_leaves_a_checkpoint_that_resumes",
    "tests/executors/training/test_file_safety.py::test_a_file_size_limit_during_a_save_is_said_and_keeps_the_previous_checkpoint",
    "tests/executors/training/test_resume.py::test_two_gloo_ranks_stop_and_resume",
    "tests/executors/training/test_sharded_optimizer.py::test_gloo_ranks_pp2_dp2_sharded_equal_the_unsharded_interpreter",
    "tests/executors/training/test_sharded_optimizer.py::test_sharded_training_equals_unsharded_over_50_steps",
    "tests/compiler/simulate/test_sharded_optimizer_memory.py::test_a_budget_met_only_with_a_sharded_optimizer",
    # (tests/executors/test_distributed_*.py mark themselves)
    # Hugging Face models (the fast tier still reads a config.json: test_hf_cli.py)
    "tests/compiler/costmodel/test_held_grads.py::test_a_hugging_face_block_keeps_what_the_graph_counts",
    "tests/compiler/frontend/test_causal_constructs.py::test_hyena_and_lfm2_convolutions_are_exact",
    "tests/compiler/frontend/test_causal_constructs.py::test_more_alibi_families_are_exact",
    "tests/compiler/frontend/test_hf_cli.py::test_chimera_runs_a_tied_hugging_face_model_exactly",
    "tests/compiler/frontend/test_hf_cli.py::test_config_json_compiles_and_runs_exactly",
    "tests/compiler/frontend/test_hf_cli.py::test_config_json_runs_exactly_under_chimera",
    "tests/compiler/frontend/test_hf_cli.py::test_config_json_runs_exactly_with_several_chunks_per_rank",
    "tests/compiler/frontend/test_hf_families.py",
    "tests/compiler/frontend/test_masks_exact.py::test_a_bidirectional_config_json_is_refused_at_the_library_line",
    "tests/compiler/frontend/test_masks_exact.py::test_a_bidirectional_encoder_is_refused_at_the_library_line_with_its_module",
    "tests/compiler/frontend/test_masks_exact.py::test_a_user_wrapper_with_the_generation_cache_on_compiles",
    "tests/compiler/frontend/test_masks_exact.py::test_mistral_sliding_window_is_exact_not_causal",
    "tests/compiler/frontend/test_masks_exact.py::test_mistral_window_smaller_than_slices_with_checkpoint_and_split_backward",
    "tests/compiler/frontend/test_masks_exact.py::test_opt_positions_are_computed_at_full_length",
    "tests/compiler/frontend/test_masks_exact.py::test_qwen2_mixes_full_and_windowed_layers",
    "tests/compiler/frontend/test_masks_exact.py::test_simulated_kv_memory_of_a_windowed_model_is_bounded_by_the_window",
    "tests/compiler/frontend/test_masks_exact.py::test_windowed_kv_cache_and_its_gradients_are_bounded_by_the_window",
    "tests/executors/test_evaluation.py::test_hugging_face_windowed_caches_evaluate_as_plain_pytorch",
    "tests/executors/training/test_init_from.py::test_a_hugging_face_config_that_differs_is_said",
    "tests/executors/training/test_init_from.py::test_export_of_a_hugging_face_model_is_a_directory_from_pretrained_loads",
    "tests/executors/training/test_init_from.py::test_init_from_a_hugging_face_directory_gives_its_own_loss",
    # long single-process runs: a large model, many steps, a resumed run, a whole corpus
    "tests/compiler/costmodel/test_host_bound.py::test_a_short_slice_on_a_hopper_gpu_waits_on_the_host",
    "tests/executors/test_run_cli.py::test_verify_grads_builds_its_reference_as_the_model_file_does",
    "tests/executors/test_torch_schedules_grads.py::test_compile_a_torch_schedule_and_run_it_from_the_command_line",
    "tests/executors/training/test_curriculum.py::test_a_misspelt_curriculum_names_the_flag",
    "tests/executors/training/test_curriculum.py::test_resume_under_another_curriculum_is_refused",
    "tests/executors/training/test_curriculum.py::test_stop_and_resume_in_the_middle_of_the_curriculum",
    "tests/executors/training/test_init_from.py::test_init_from_with_resume_starts_once_then_resumes",
    "tests/executors/training/test_resume.py::test_stop_at_20_and_resume_to_30_is_the_uninterrupted_run",
    "tests/executors/training/test_token_file.py::test_corpus_is_byte_tokens_of_python_source",
    "tests/executors/training/test_train_vs_pytorch.py",
    "tests/ir/test_roundtrip_property.py::test_mutated_text_parses_or_fails_located",
    # matrices of cases and further end-to-end runs (compile, train, compare against autograd)
    # of what faster tests of the same modules check
    "tests/compiler/costmodel/test_graph_costs.py::test_compile_and_simulate_price_any_capturable_model",
    "tests/compiler/frontend/test_causal_constructs.py::test_sliced_equals_autograd",
    "tests/compiler/frontend/test_masks_exact.py::test_a_banded_mask_is_sliced_exactly_at_its_width",
    "tests/compiler/frontend/test_masks_exact.py::test_other_masks_are_refused_saying_what_they_are",
    "tests/compiler/frontend/test_masks_exact.py::test_the_self_check_runs_the_given_slices_at_the_plans_length",
    "tests/compiler/frontend/test_portable_stages.py::test_math_sdpa_backend_matches_oracle",
    "tests/compiler/frontend/test_portable_stages.py::test_stage_graphs_have_no_view",
    "tests/compiler/frontend/test_units_and_runtime.py::test_mask_buffer_as_long_as_the_sequence",
    "tests/compiler/simulate/test_timeline.py::test_device_model_prices_a_compiled_plan_in_seconds",
    "tests/compiler/simulate/test_timeline.py::test_gantt_png_is_written_and_shows_forward_and_backward",
    "tests/compiler/test_auto.py::test_chimera_is_searched_for_an_untied_model",
    "tests/compiler/test_auto.py::test_chosen_plan_is_never_slower_than_equal_slicing",
    "tests/compiler/test_auto.py::test_compile_stages_auto_end_to_end_trains_like_autograd",
    "tests/compiler/test_auto.py::test_microbatches_auto_compiles_and_trains_like_autograd",
    "tests/compiler/test_auto.py::test_pruning_bound_is_a_lower_bound",
    "tests/compiler/test_auto.py::test_schedule_auto_is_the_fastest_schedule_that_fits",
    "tests/compiler/test_auto.py::test_stages_auto_over_four_ranks_matches_brute_force",
    "tests/compiler/test_compile.py::test_a_failed_compile_leaves_an_existing_plan_untouched",
    "tests/compiler/test_compile.py::test_auto_slices_take_the_optimisers_choice",
    "tests/compiler/test_compile.py::test_compile_each_schedule",
    "tests/compiler/test_compile.py::test_compile_lowers_and_verifies_for_the_backend_it_targets",
    "tests/compiler/test_compile_options_17.py::test_recompute_auto_recomputes_the_stages_over_the_budget_and_says_so",
    "tests/compiler/test_compile_options_17.py::test_virtual_stages_loop_the_stages_over_the_ranks",
    "tests/compiler/test_compile_options_17.py::test_virtual_stages_with_data_parallel_replicas",
    "tests/compiler/test_nccl_rules.py::test_every_schedule_passes_nccl_rules",
    "tests/compiler/test_schedules_chimera.py::test_every_shape_lowers_to_a_plan_verified_under_both_backends",
    "tests/compiler/test_schedules_chimera_doubling.py::test_every_shape_lowers_to_a_plan_verified_under_both_backends",
    "tests/executors/test_chimera_doubling.py::test_torchrun_gloo_matches_autograd_and_the_interpreter",
    "tests/executors/test_random_ltd.py::test_torchrun_gloo_verify_grads",
    "tests/executors/test_random_ltd_plan.py::test_torchrun_gloo_verify_grads_of_a_compiled_plan",
    "tests/compiler/costmodel/test_random_ltd_costs.py::test_the_partition_follows_the_dropped_units",
    "tests/executors/test_random_ltd.py::test_with_the_sequence_length_curriculum_two_steps_equal_the_oracles",
    "tests/executors/test_random_ltd.py::test_a_hugging_face_llama_with_rope_matches_the_oracle",
    "tests/executors/test_chimera_doubling.py::test_tied_models_match_autograd_in_the_interpreter[hf-gpt2-3-2-5]",
    "tests/compiler/test_schedules_chunks.py::test_looped_placements_lower_to_verified_plans",
    "tests/compiler/test_schedules_vshape.py::test_v_shapes_lower_to_verified_plans",
    "tests/executors/test_interpreter_fake.py::test_gradients_match_autograd",
    "tests/executors/test_interpreter_models.py::test_carried_state_and_position_biases_match_autograd",
    "tests/executors/test_interpreter_models.py::test_gpt_every_schedule_matches_autograd",
    "tests/executors/test_interpreter_models.py::test_other_models_match_autograd",
    "tests/executors/test_interpreter_schedules.py::test_chimera_matches_autograd",
    "tests/executors/test_interpreter_schedules.py::test_two_chunks_per_rank_match_autograd",
    "tests/executors/test_run_cli.py::test_a_trace_that_cuts_other_units_is_refused",
    "tests/executors/test_run_cli.py::test_changed_model_file_is_refused",
    "tests/executors/test_run_cli.py::test_metrics_file",
    "tests/executors/test_run_cli.py::test_trace_is_chrome_json",
    "tests/executors/test_run_cli.py::test_verify_grads_fails_above_tolerance",
    "tests/executors/test_run_cli.py::test_warmup_and_clipping",
    "tests/executors/test_sent_buffers.py::test_a_stage_keeps_no_activation_it_sent_and_its_backward_is_unchanged",
    "tests/executors/test_torch_schedules_grads.py::test_torch_schedule_runs_exactly",
    "tests/executors/test_stage_programs.py::test_split_backward_is_one_backward[first-gpt]",
    "tests/executors/test_stage_programs.py::test_split_backward_is_one_backward[first-llama]",
    "tests/executors/test_stage_programs.py::test_split_backward_is_one_backward[last-llama]",
    "tests/executors/test_stage_programs.py::test_split_backward_is_one_backward[middle-llama]",
    "tests/executors/test_stage_programs.py::test_split_backward_is_one_backward[whole-gpt]",
    "tests/executors/test_stage_programs.py::test_split_backward_is_one_backward[whole-llama]",
    "tests/executors/training/test_curriculum.py::test_reshape_keeps_the_tokens_of_a_step_and_matches_plain_pytorch",
    "tests/executors/training/test_init_from.py::test_a_pickle_that_is_not_weights_only_is_refused",
    "tests/executors/training/test_init_from.py::test_init_from_an_export_gives_the_exporting_runs_loss",
    "tests/executors/training/test_init_from.py::test_truncated_files_are_refused",
    "tests/executors/training/test_init_from.py::test_weights_of_another_model_are_refused",
    "tests/executors/training/test_resume.py::test_export_computes_what_the_pipeline_computes",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[bloom]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[mamba]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[falcon_mamba]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[jamba]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[zamba]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[mamba2]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[bamba]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[zamba2]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[granitemoehybrid]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[nemotron_h]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[falcon_h1]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[rwkv]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[recurrent_gemma]",
    "tests/compiler/frontend/test_ssm.py::test_the_self_check_leaves_the_models_own_state_as_it_was",
    "tests/compiler/frontend/test_ssm.py::test_state_space_families_are_exact",
    "tests/compiler/frontend/test_ssm.py::test_packed_documents_are_refused_at_the_scan",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[falcon]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[falcon_alibi]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[gemma]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[gemma2]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[gpt2]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[gpt_neox]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[lfm2]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[mistral]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[mpt]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[opt]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[phi3]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[qwen2]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[qwen3]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[starcoder2]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[deepseek_v3]",
    "tests/compiler/frontend/test_trainable_plans.py::test_deepseek_v3_latent_attention_is_exact",
    "tests/compiler/frontend/test_trainable_plans.py::test_the_new_families_recompute_and_split_their_backward_exactly",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[gpt_oss]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[xglm]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[llama4_text]",
    "tests/compiler/frontend/test_score_transforms.py::test_score_transforms_are_exact_over_the_cached_prefix",
    "tests/compiler/frontend/test_experts.py::test_mixture_of_experts_families_are_exact",
    "tests/compiler/frontend/test_experts.py::test_the_auxiliary_loss_is_refused_at_its_key_in_the_config",
    "tests/compiler/frontend/test_chunked_attention.py::test_llama4_chunked_attention_is_exact",
    "tests/compiler/frontend/test_chunked_attention.py::test_simulated_kv_memory_of_a_chunked_model_is_bounded_by_the_chunk",
    "tests/compiler/frontend/test_new_families_torchrun.py",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[dots1]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[granitemoe]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[qwen3_moe]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[deepseek_v3_moe]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[olmoe]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[qwen2_moe]",
    "tests/compiler/frontend/test_weightless.py::test_every_family_checks_unit_by_unit[mixtral]",
)


def _is_slow(nodeid: str) -> bool:
    for entry in SLOW:
        if nodeid == entry or (nodeid.startswith(entry) and nodeid[len(entry)] in ":[/"):
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
        group = _shared_fixture_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    # The files that hold slow tests run first, each file's tests together and in their order
    # (its module fixtures are made once): pytest-xdist hands the tests out in this order
    # (.ci/run: --dist loadgroup --no-loadscope-reorder), so the long multi-process tests start
    # early and the workers end together on short tests rather than one worker running the last
    # torchrun tests alone.
    heavy = {_file(item) for item in items if item.get_closest_marker("slow")}
    items[:] = sorted(items, key=lambda item: _file(item) not in heavy)


def _file(item) -> str:
    return item.nodeid.split("::")[0]


def _shared_fixture_group(item) -> str | None:
    """Under `--dist loadgroup` (.ci/run) the tests are handed out one at a time, except the
    tests that share a fixture made once per module (a torchrun launch of all of a file's cases,
    a compiled plan) or once per session by a folder's conftest (a measured profile): these go
    to one worker together, so that the fixture is made once rather than once per worker. The
    group is the file, or the folder of the conftest that defines the session fixture."""
    group = None
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        fixture = defs[-1]
        code = getattr(fixture.func, "__code__", None)
        where = Path(code.co_filename).resolve().parent if code else None
        if where is None or not where.is_relative_to(ROOT / "tests"):
            continue  # pytest's own (tmp_path_factory, ...)
        if fixture.scope == "session" and where != ROOT / "tests":
            return where.relative_to(ROOT).as_posix()  # (tests/conftest.py's are paths, made at once)
        if fixture.scope in ("module", "class", "package"):
            group = _file(item)
    return group
